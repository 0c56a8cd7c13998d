// What the AMX kernels (amx_int8.cpp, amx_bf16.cpp) share: the OS's permission to use the tiles, and the one tile
// configuration both run with.
#pragma once

#if defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#define LEVERLAB_AMX_TILE 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux keeps AMX's tile data disabled for a process until it asks (arch_prctl ARCH_REQ_XCOMP_PERM); the grant
// holds for every thread of the process. Asked once.
inline bool permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Palette 1, all eight tiles 16 rows x 64 bytes. A constant in read-only memory: a configuration built on the
// stack can lose its stores to the optimizer, which does not see LDTILECFG read them (llama.cpp #26954).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

}  // namespace amx

#endif
