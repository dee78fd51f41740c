// Prefix groups for paged_attention_cpu.cpp: decode sequences whose block tables begin with the same
// blocks (a prefix-cache hit), which one work item serves by reading each shared block once (its Item).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace hasten_attention {

// Decode sequences (one new token) grouped by shared leading blocks; see Item. A group is formed
// from sequences whose first block is the same, split into groups of at most `max_members`, each
// sharing the blocks all its members have in common (at least 2, or the members go alone).
struct Groups {
  std::vector<int64_t> members;                 // sequence ids, group after group
  std::vector<std::array<int64_t, 3>> spans;    // member_begin, member_end, shared blocks
  std::vector<bool> grouped;                    // per sequence
};

inline Groups find_groups(const int32_t* tables, const int64_t* qs, const int64_t* ctx, int64_t S, int64_t BS,
                          int64_t max_blocks, int64_t max_members) {
  Groups g;
  g.grouped.assign(S, false);
  if (max_members < 2) return g;
  std::vector<int64_t> decode;
  for (int64_t s = 0; s < S; ++s)
    if (qs[s + 1] - qs[s] == 1 && ctx[s] > BS) decode.push_back(s);
  // sequences with the same first block end up next to each other (stable: keeps batch order)
  std::stable_sort(decode.begin(), decode.end(),
                   [&](int64_t a, int64_t b) { return tables[a * max_blocks] < tables[b * max_blocks]; });
  auto common = [&](int64_t a, int64_t b) {  // leading blocks a and b share, within both contexts
    const int64_t n = std::min((ctx[a] - 1) / BS + 1, (ctx[b] - 1) / BS + 1);
    int64_t c = 0;
    while (c < n && tables[a * max_blocks + c] == tables[b * max_blocks + c]) ++c;
    return c;
  };
  size_t i = 0;
  while (i < decode.size()) {
    size_t j = i + 1;
    while (j < decode.size() && tables[decode[j] * max_blocks] == tables[decode[i] * max_blocks]) ++j;
    // [i, j): one first block; cut it into groups of at most max_members
    const int64_t run = static_cast<int64_t>(j - i);
    const int64_t ngroups = (run + max_members - 1) / max_members;
    for (int64_t k = 0; k < ngroups; ++k) {
      const size_t b = i + static_cast<size_t>(k * run / ngroups), e = i + static_cast<size_t>((k + 1) * run / ngroups);
      if (e - b < 2) continue;
      int64_t shared = max_blocks;
      for (size_t m = b + 1; m < e; ++m) shared = std::min(shared, common(decode[b], decode[m]));
      if (shared < 2) continue;
      const int64_t begin = static_cast<int64_t>(g.members.size());
      for (size_t m = b; m < e; ++m) {
        g.members.push_back(decode[m]);
        g.grouped[decode[m]] = true;
      }
      g.spans.push_back({begin, static_cast<int64_t>(g.members.size()), shared});
    }
    i = j;
  }
  return g;
}

}  // namespace hasten_attention
