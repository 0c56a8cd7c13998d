// y = x W^T (+ b) in bfloat16 on AMX tiles (TDPBF16PS), for decode-sized batches: 1..kMaxRows rows, W read in place.
//
// Why: the streaming bf16 kernel (skinny_linear.cpp) multiplies with vdpbf16ps, which issues every other cycle on a
// Sapphire/Emerald Rapids core, ~45 G multiply-adds a second on two cores: past a few rows a decode step computes
// for longer than it reads its weights. One TDPBF16PS multiplies a 16 x 32 block of W by 32 x 16 of x in ~16
// cycles, ~1,000 multiply-adds a cycle, so on tiles a step stays a memory stream up to 32 rows. Measured on a
// 2-vCPU Xeon with AMX (a pass over the Qwen3-0.6B shape's 112 layer matrices, 0.9 GB, two threads,
// best of 5): 16 rows 118-161 ms on the streaming kernel, 67-90 on aten's (oneDNN, AMX too, but repacking W per
// call), 41-42 here; 1 row 63-67 streaming, 41-44 here; 32 rows 295-308, 75-102, 49-52.
//
// Layout. W stays as the model holds it, [N, K] row-major: 16 of its rows x 64 bytes (stride 2K bytes) is an A tile
// as TILELOADD reads it, so nothing is repacked and no second copy is kept. x is the B tile: TDPBF16PS wants B's
// row r to hold the pairs (k = 2r, 2r + 1) of 16 columns, so x is packed per call (pack_x) as
// [K/32][Mb][16 r][16 m] pairs of bf16, Mb = 1 or 2 groups of 16 rows, zero past M. C = A B is then y^T,
// [16 n][16 m] float32; store_block transposes it on the way out (in registers, amx_util.h), adds the bias and
// rounds to bf16 once (vcvtne2ps2bf16: to nearest even, as aten rounds).
// Each step of the inner loop takes 32 weight rows (two A tiles) against one or two B tiles: 2 or 4 C tiles.
//
// Numerics: fp32 sums in tile order over K. A row's result depends neither on the other rows of the batch nor on
// which thread computes it; it differs in the last bits from the streaming kernel's, as aten's does (bf16 models
// only: float32 ones never come here).
// No software prefetch: on that Xeon, prefetching each weight row 256 B-2 KB ahead, or the next block of rows,
// read no faster than the hardware prefetchers alone (the same passes, 1, 4, 16 and 32 rows).
#include <torch/extension.h>

#include "amx_util.h"
#include "kernel_util.h"
#include "row_split.h"
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(LEVERLAB_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LEVERLAB_AMX_BF16 1
#endif

namespace {

constexpr int64_t kMaxRows = 32;  // activation rows: two B tiles
constexpr int64_t kBlock = 32;    // weight rows per inner loop: two A tiles
constexpr int64_t kDepth = 32;    // bf16 elements of K per tile row (64 bytes)

// Whether linear_bf16 takes its rows here: built for it, the OS grants the tiles, and not switched off
// (set_amx_bf16(false): kernels/cpu_kernels.py does so at load under LEVERLAB_NO_AMX=1, A/B runs in one process).
std::atomic<bool>& enabled() {
#ifdef LEVERLAB_AMX_BF16
  static std::atomic<bool> on{amx::permitted()};
#else
  static std::atomic<bool> on{false};
#endif
  return on;
}

#ifdef LEVERLAB_AMX_BF16
// x [M, K] (row stride ldx elements) -> xb [K/32][Mb][16 r][16 m] pairs, zero where m >= M. Each tile is the 16 x 16
// transpose of 32-bit words of its 16 rows' 64 bytes (amx::transpose16): scattered 4 bytes at a time it had cost
// 2.6 us a call at 16 rows and K 1,024 and 26 us at K 3,072 (one thread, weights in cache), ~1 ms of a 16-sequence
// decode step of the 0.6B shape.
void pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t Mb, uint32_t* xb) {
  const int64_t KC = K / kDepth;
  for (int64_t g = 0; g < Mb; ++g)
    for (int64_t kc = 0; kc < KC; ++kc) {
      __m512i w[16];
      for (int m = 0; m < 16; ++m) {
        const int64_t row = 16 * g + m;
        w[m] = row < M ? _mm512_loadu_si512(x + row * ldx + kc * kDepth) : _mm512_setzero_si512();
      }
      amx::transpose16(w);  // w[r] lane m: row m's pair (2 r, 2 r + 1) of this chunk
      uint32_t* t = xb + (kc * Mb + g) * 256;
      for (int r = 0; r < 16; ++r) _mm512_store_si512(t + 16 * r, w[r]);
    }
}

// Sums of the 32 weight rows at w (row stride K) against Mb B tiles: c [32 n][16 Mb m] float32.
template <int Mb>
inline void block_sums(const uint16_t* w, int64_t K, const uint32_t* xb, float* c) {
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (Mb == 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t ld = K * 2;
  for (int64_t kc = 0; kc < K / kDepth; ++kc) {
    const uint16_t* a = w + kc * kDepth;
    _tile_loadd(0, a, ld);
    _tile_loadd(1, a + 16 * K, ld);
    _tile_loadd(2, xb + kc * Mb * 256, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
    if constexpr (Mb == 2) {
      _tile_loadd(3, xb + (kc * 2 + 1) * 256, 64);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  constexpr int64_t ldc = 16 * Mb;  // floats per row of c
  _tile_stored(4, c, ldc * 4);
  _tile_stored(5, c + 16 * ldc, ldc * 4);
  if constexpr (Mb == 2) {
    _tile_stored(6, c + 16, ldc * 4);
    _tile_stored(7, c + 16 * ldc + 16, ldc * 4);
  }
}

// y[m, n0 .. n0 + rows) = c[., m] + bias for each activation row m: each 16 x 16 quadrant of c transposed in
// registers (amx::transpose16), then a row's 32 sums rounded to bf16 together.
template <int Mb>
inline void store_block(const float* c, int64_t M, const float* bias, int64_t n0, int64_t rows, uint16_t* y,
                        int64_t N) {
  constexpr int ldc = 16 * Mb;
  const __mmask32 keep = rows >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << rows) - 1);
  __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
  if (bias) {
    b_lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep), bias + n0);
    b_hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> 16), bias + n0 + 16);
  }
  for (int h = 0; h < Mb && 16 * h < M; ++h) {
    __m512i lo[16], hi[16];  // weight rows 0..15 and 16..31 of activation rows 16 h .. + 15
    for (int i = 0; i < 16; ++i) {
      lo[i] = _mm512_castps_si512(_mm512_loadu_ps(c + i * ldc + 16 * h));
      hi[i] = _mm512_castps_si512(_mm512_loadu_ps(c + (16 + i) * ldc + 16 * h));
    }
    amx::transpose16(lo);
    amx::transpose16(hi);
    for (int64_t j = 0; j < 16 && 16 * h + j < M; ++j) {
      const __m512 l = _mm512_add_ps(_mm512_castsi512_ps(lo[j]), b_lo);
      const __m512 u = _mm512_add_ps(_mm512_castsi512_ps(hi[j]), b_hi);
      _mm512_mask_storeu_epi16(y + (16 * h + j) * N + n0, keep,
                               reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(u, l)));
    }
  }
}

template <int Mb>
void gemm(const uint16_t* w, int64_t N, int64_t K, const uint32_t* xb, int64_t M, const float* bias, uint16_t* y) {
  parallel_rows(N, [&](int64_t n0, int64_t n1) {
    _tile_loadconfig(&amx::kConfig);
    alignas(64) float c[kBlock * 16 * Mb];
    int64_t n = n0;
    for (; n + kBlock <= n1; n += kBlock) {
      block_sums<Mb>(w + n * K, K, xb, c);
      store_block<Mb>(c, M, bias, n, kBlock, y, N);
    }
    if (n < n1) {  // the matrix's last rows, fewer than a block: copied out, zero-padded, so no tile reads past W
      amx::tile_vector<uint16_t> pad(static_cast<size_t>(kBlock * K), 0);
      std::memcpy(pad.data(), w + n * K, static_cast<size_t>((n1 - n) * K * 2));
      block_sums<Mb>(pad.data(), K, xb, c);
      store_block<Mb>(c, M, bias, n, n1 - n, y, N);
    }
    _tile_release();  // a thread holding no tile state saves and restores less on every context switch
  });
}
#endif

}  // namespace

bool amx_bf16_enabled() { return enabled().load(std::memory_order_relaxed); }

// Returns whether it is on after the call: on only where the build and the OS allow it.
bool set_amx_bf16(bool on) {
#ifdef LEVERLAB_AMX_BF16
  enabled().store(on && amx::permitted(), std::memory_order_relaxed);
#else
  (void)on;
#endif
  return amx_bf16_enabled();
}

// Whether amx_bf16_linear takes x [M, K] against w [N, K] (both bf16, checked by the caller): 1..32 rows, K a
// multiple of 32, contiguous rows.
bool amx_bf16_takes(const torch::Tensor& x, const torch::Tensor& w) {
  return amx_bf16_enabled() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.stride(1) == 1 &&
         x.size(1) % kDepth == 0 && w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous();
}

torch::Tensor amx_bf16_linear(const torch::Tensor& x, const torch::Tensor& w,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "amx_bf16_linear: bfloat16");
  TORCH_CHECK(amx_bf16_enabled(), "amx_bf16_linear: off here (no AMX-BF16 in this build or CPU, or LEVERLAB_NO_AMX=1)");
  TORCH_CHECK(amx_bf16_takes(x, w), "amx_bf16_linear: x [1..", kMaxRows, ", K] with contiguous rows, w [N, K] "
              "contiguous, K a multiple of ", kDepth);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
#ifdef LEVERLAB_AMX_BF16
  at::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  TORCH_CHECK(!bp || b32.numel() == N, "amx_bf16_linear: bias has ", b32.numel(), " elements, not ", N);
  const int64_t Mb = M <= 16 ? 1 : 2;
  amx::tile_vector<uint32_t> xb(static_cast<size_t>(K / kDepth * Mb * 256));
  pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), M, K, Mb, xb.data());
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  if (Mb == 1)
    gemm<1>(wp, N, K, xb.data(), M, bp, yp);
  else
    gemm<2>(wp, N, K, xb.data(), M, bp, yp);
#else
  (void)bias;
#endif
  return y;
}
