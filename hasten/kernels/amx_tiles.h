// What the AMX kernels share (gemm_bf16_amx_cpu.cpp, attention_amx.h): the tile configuration block
// and the check that this CPU has the tile units and that Linux has handed the process their state.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace hasten_amx {

// LDTILECFG's 64-byte block (palette 1): each tile register's bytes per row and rows
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// CPUID leaf 7 EDX: AMX-BF16 bit 22, AMX-TILE bit 24, AMX-INT8 bit 25.
constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24, kAmxInt8 = 1u << 25;

// Whether the CPU has the given AMX units (with AMX-TILE) and Linux granted the process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: asked once, for the whole process).
inline bool amx_ready(unsigned units) {
  static const unsigned present = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & kAmxTile)) return 0u;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? d : 0u;
  }();
  return (present & units) == units && units != 0;
}

// LDTILECFG with all 8 tiles 16 rows of 64 bytes (palette 1), the layout every kernel here uses. The
// block lives in static storage: GCC models the instruction's read of it too narrowly, and a block on
// the stack had its column stores dropped when the slot was reused right after the load (the load
// then faults on rows without columns).
inline void configure_16x64_tiles() {
  static const TileConfig cfg = [] {
    TileConfig c{};
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

}  // namespace hasten_amx
#endif
