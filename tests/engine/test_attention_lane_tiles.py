"""attention_lane_tiles: over an int8, float16 or bfloat16 cache, prefill tiles put their query rows in
the vector lanes and widen each block of keys and values once per tile (attention_lane_tiles.h). The
kernel against a float64 reference over the cache's values, on ragged shapes; what it leaves to the
per-token path (bit for bit); the switch; and the engine with it against the engine without it."""

from __future__ import annotations

import pytest
import torch

from hasten import LLM
from hasten.kernels import cpu_attention
from tests.engine.test_attention_kernel import CASES, attention_on_threads, make_inputs, reference
from tests.engine.test_int8_kv_cache import INT8_SCORE_CASES, int8_inputs

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="C++ kernels cannot be built here")

LANE_CASES = CASES + INT8_SCORE_CASES[1:4] + [
    ([300, 40], [300, 40], 9, 3, 64, 16),  # long prefill: whole 64-key steps, then a partial one
    ([500], [61], 2, 1, 64, 16),  # a chunk after 439 cached tokens, 2 rows per token (tiles of 32 tokens)
    ([90, 12], [90, 12], 5, 5, 96, 8),  # MHA, head_dim 96, blocks of 8; 12 tokens = one tile
    ([70], [70], 16, 2, 64, 32),  # 8 query heads per kv head: tiles of 8 tokens, blocks of 32
    ([40], [40], 4, 1, 256, 16),  # head_dim 256
]


def narrow(inputs, cache_dtype):
    """(kernel inputs, reference inputs) over a cache of `cache_dtype`."""
    if cache_dtype == torch.int8:
        return int8_inputs(inputs)
    q, k, v, tables, qs, cl = inputs
    k, v = k.to(cache_dtype), v.to(cache_dtype)
    return (q, k, v, tables, qs, cl), (q, k.float(), v.float(), tables, qs, cl)


def taken(head_dim: int, lanes: int = 1) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256 and lanes > 0 and cpu_attention.lane_tiles_available()


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", LANE_CASES, ids=[f"case{i}" for i in range(len(LANE_CASES))])
@pytest.mark.parametrize("threads", [1, 2])
def test_lane_tiles_match_float64_over_the_cache_values(case, cache_dtype, threads):
    ctx, new, heads, kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(sum(ctx) * 7 + head_dim + block_size + threads)
    packed, values = narrow(make_inputs(gen, ctx, new, heads, kv_heads, head_dim, block_size, torch.float32), cache_dtype)
    scale = head_dim**-0.5
    got = attention_on_threads(threads, *packed, scale, lane_tokens=4)
    assert got.shape == (sum(new), heads * head_dim)
    assert (got.double() - reference(*values, scale)).abs().max().item() < 2e-5
    plain = attention_on_threads(threads, *packed, scale)
    rows = torch.repeat_interleave(torch.tensor(new) >= 4, torch.tensor(new))
    # sequences with fewer new tokens than lane_tokens keep the per-token path, bit for bit
    assert torch.equal(got[~rows], plain[~rows])
    if taken(head_dim) and rows.any():
        assert not torch.equal(got[rows], plain[rows])  # taken: the sums run in another order


def test_lane_tiles_threshold_and_what_they_leave_alone():
    gen = torch.Generator().manual_seed(5)
    inputs = make_inputs(gen, [120, 40, 9], [120, 7, 3], 9, 3, 64, 16, torch.float32)
    packed, _ = int8_inputs(inputs)
    plain = cpu_attention.paged_attention(*packed, 0.125)
    assert torch.equal(cpu_attention.paged_attention(*packed, 0.125, lane_tokens=0), plain)  # off
    got = cpu_attention.paged_attention(*packed, 0.125, lane_tokens=8)  # the 7- and 3-token sequences stay
    assert torch.equal(got[120:], plain[120:])
    assert torch.equal(got[:120], plain[:120]) != taken(64)
    for kw in (dict(softcap=30.0), dict(window=50)):  # soft caps and windows short of key 0: the general path
        got = cpu_attention.paged_attention(*packed, 0.125, lane_tokens=4, **kw)
        plain = cpu_attention.paged_attention(*packed, 0.125, **kw)
        assert torch.equal(got[:120], plain[:120])
        # the 40-token sequence's window reaches key 0 (plain causal attention): its 7 new tokens are taken
        assert torch.equal(got[120:127], plain[120:127]) != (taken(64) and "window" in kw)
    # a float32 cache keeps its exact path
    assert torch.equal(cpu_attention.paged_attention(*inputs, 0.125, lane_tokens=4), cpu_attention.paged_attention(*inputs, 0.125))
    with pytest.raises(RuntimeError, match="lane_tokens"):
        cpu_attention.paged_attention(*packed, 0.125, lane_tokens=-1)


def test_lane_tiles_beside_the_other_int8_paths():
    # int8_rows' packed path takes its sequences first; int8_decode the ones under lane_tokens
    gen = torch.Generator().manual_seed(9)
    packed, values = int8_inputs(make_inputs(gen, [100, 64, 9, 300], [100, 3, 9, 40], 9, 3, 64, 16, torch.float32))
    both = cpu_attention.paged_attention(*packed, 0.125, int8_rows=50, int8_decode=True, lane_tokens=4)
    new = torch.tensor([100, 3, 9, 40])
    packed_rows = torch.repeat_interleave(new >= 50, new)
    short = torch.repeat_interleave(new < 4, new)
    # (a build without AVX-512 VNNI ignores int8_rows: those sequences reach the lane tiles too)
    first = dict(int8_rows=50) if cpu_attention.int8_scores_available() else dict(lane_tokens=4)
    assert torch.equal(both[packed_rows], cpu_attention.paged_attention(*packed, 0.125, **first)[packed_rows])
    assert torch.equal(both[short], cpu_attention.paged_attention(*packed, 0.125, int8_decode=True)[short])
    lanes = ~packed_rows & ~short
    assert torch.equal(both[lanes], cpu_attention.paged_attention(*packed, 0.125, lane_tokens=4)[lanes])
    assert (both[lanes].double() - reference(*values, 0.125)[lanes]).abs().max().item() < 2e-5


def test_lane_tiles_switch_resolves(monkeypatch):
    from hasten.kernels import cpu_features

    resolve = cpu_features.resolve_lane_tiles
    assert resolve("off", 4) == 0
    monkeypatch.setattr(cpu_attention, "lane_tiles_available", lambda: True)
    monkeypatch.setattr(cpu_attention, "int8_scores_available", lambda: False)
    assert resolve("auto", 4) == 4 and resolve("on", 6) == 6
    monkeypatch.setattr(cpu_attention, "int8_scores_available", lambda: True)  # AVX-512 VNNI builds: auto off
    assert resolve("auto", 4) == 0 and resolve("on", 4) == 4
    monkeypatch.setattr(cpu_attention, "lane_tiles_available", lambda: False)
    assert resolve("auto", 4) == 0
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        resolve("on", 4)
    with pytest.raises(ValueError, match="attention_lane_tiles must be one of"):
        resolve("yes", 4)
    with pytest.raises(ValueError, match="attention_lane_tiles_min_tokens must be >= 1"):
        resolve("on", 0)


def test_engine_with_lane_tiles_stays_close_to_the_per_token_path(tiny_models):
    from tests.quant.wide_paths import assert_loops_agree, prompt_logprob_gap

    path = tiny_models("llama", hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64
    # 24-token steps, the int8 paths of AVX-512 builds off: every prompt chunk reaches the lane tiles
    kw = dict(kv_cache_dtype="int8", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24,
              attention_int8_scores="off", attention_int8_decode="off")
    if not cpu_attention.lane_tiles_available():  # a build without AVX2: auto is off, on refused
        assert LLM(path, **kw).engine.model.prefill_attention.lane_tokens == 0
        with pytest.raises(ValueError, match="AVX2 and FMA"):
            LLM(path, attention_lane_tiles="on", **kw)
        return
    on = LLM(path, attention_lane_tiles="on", **kw)
    off = LLM(path, attention_lane_tiles="off", **kw)
    assert on.engine.model.prefill_attention.lane_tokens == 4
    assert off.engine.model.prefill_attention.lane_tokens == 0
    # the C++ layer loop and the Python one call the kernel alike: bit-identical
    assert_loops_agree(on, LLM(path, attention_lane_tiles="on", native_decoder_loop=False, **kw))
    assert 0.0 < prompt_logprob_gap(on, off) < 1e-3  # taken (the order of sums shows), float32 rounding only
