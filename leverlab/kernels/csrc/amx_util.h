// What the AMX kernels (amx_int8.cpp, amx_bf16.cpp) share: the OS's permission to use the tiles, and the one tile
// configuration both run with.
#pragma once

#if defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#define LEVERLAB_AMX_TILE 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace amx {

// Storage for what tiles load or store: 64-byte aligned, so that each of a tile's 16 rows of 64 bytes is one cache
// line. glibc's malloc aligns to 16, and a row that straddles two lines loads at a third of the rate: four tile
// loads from L1 took 62 ns misaligned and 10 ns aligned (a 1,024-row int8 GEMM at K 1,024 ran ~600 against ~1,750
// G multiply-adds a second, one thread of that Xeon, a stand-alone loop of amx_int8.cpp's tile steps).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using tile_vector = std::vector<T, Aligned64<T>>;

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

// r[0..15], 16 lanes of 32 bits each, transposed in registers: afterwards lane j of r[i] is what lane i of r[j]
// was. The C tiles hold y transposed (weight rows by activation rows); this turns 16 x 16 of them into y's rows with
// 64 shuffles, where gathering each row (16 lanes, stride a C row) had cost as much as the tile products at 32 rows.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 4) {  // pairs of 32-bit lanes, then of 64-bit lanes, within each 128-bit lane
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    t[i + 2] = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
    t[i + 3] = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // then whole 128-bit lanes across the four groups of four rows
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

}  // namespace amx

#endif
