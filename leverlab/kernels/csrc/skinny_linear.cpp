// y = x W^T (+ b) for a few rows of x (1..32), in bfloat16: with AVX-512 BF16 dot products (dpbf16 below), else
// with the weights widened to float32 in registers (widen, for AVX2 and AVX-512F).
//
// Decode multiplies 1..32 activation rows by every weight matrix: the work is reading W once, so the kernel is
// a streaming loop. Each thread walks its share of W's rows one row after the other, so the reads form one
// sequential stream, and applies each 32-element weight chunk to every activation row while it is in
// registers. Accumulation is fp32 (dpbf16ps multiplies bf16 pairs exactly and adds in fp32); each output is
// rounded to bf16 once, as aten's linear does.
//
// Why one row at a time: an earlier version streamed 2..8 weight rows side by side for more misses in flight.
// Measured against it with 2 threads on a 0.9 GB Qwen3-0.6B-shaped stack (same run, torch.sum reading at
// 45 GB/s): 1 row 34 -> 45 GB/s, 2 rows 33 -> 45, 4 rows 36 -> 45, 6 rows 31 -> 41; the hardware prefetcher
// follows one stream per core best. At 7-8 rows the loop is compute-heavy enough that both did ~35.
#include <torch/extension.h>

#include "kernel_util.h"
#include "row_split.h"
#include "stream_hint.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LEVERLAB_SKINNY_WIDEN 1

// AVX2 + FMA (Zen 2/3, Haswell and later), and AVX-512F without BF16 (Ice Lake .. Emerald Rapids as some VMs show
// them): no bf16 dot product, so the kernel widens the weights to float32 in registers. A 32-bit lane holding bf16
// elements (2i, 2i+1) gives element 2i+1 as a float by masking off the low half and element 2i by shifting it
// left 16: two integer ops per vector of weights, no shuffles. The activations are widened once per call into
// that same order (even elements, then odd, per chunk of 2W, W floats to a vector), so each chunk costs one load,
// two integer ops and 2 * M FMAs, and stays ahead of one core's memory stream. With AVX-512 a chunk is 32
// weights and a group takes up to 8 activation rows (32 registers: 16 accumulators), where AVX2 takes 16 and 4:
// on a Xeon, 1.7-1.8x the AVX2 code at 8-16 rows over the Qwen3-0.6B shape's matrices, and batch-16 decode
// went from 0.53x llama.cpp's AVX-512 path to 0.68-0.74x (still compute-bound on the widening and the FMAs).

namespace widen {

struct Avx2 {
  using F = __m256;
  static constexpr int W = 8, kGroup = 4;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float sum(F a) { return hsum8(a); }
  static void widen(const uint16_t* p, F& even, F& odd) { widen_bf16x16(p, even, odd); }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
  using F = __m512;
  static constexpr int W = 16, kGroup = 8;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float sum(F a) { return _mm512_reduce_add_ps(a); }
  static void widen(const uint16_t* p, F& even, F& odd) {  // 32 bf16 values, as widen_bf16x16
    const __m512i w = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
using Vec = Avx512;
#else
using Vec = Avx2;
#endif

// x [M, K] bf16 -> xs [M, KC] float32, KC = K rounded up to a chunk C = 2W: per chunk, the W even elements then
// the W odd ones (zero past K, so the masked tail of a weight row adds nothing).
template <int C>
void widen_split(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* xs, int64_t KC) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * ldx;
    float* d = xs + m * KC;
    for (int64_t c = 0; c < KC; c += C)
      for (int j = 0; j < C / 2; ++j) {
        const int64_t e = c + 2 * j, o = e + 1;
        uint32_t be = e < K ? static_cast<uint32_t>(xr[e]) << 16 : 0u, bo = o < K ? static_cast<uint32_t>(xr[o]) << 16 : 0u;
        std::memcpy(d + c + j, &be, 4);
        std::memcpy(d + c + C / 2 + j, &bo, 4);
      }
  }
}

// Output column n for M activation rows (M <= V::kGroup): U chunks in flight, even and odd halves in separate
// accumulators, so M * U * 2 independent FMA chains cover the FMA latency without spilling.
template <typename V, int M, int U>
inline void column(const float* xs, int64_t KC, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
                   int64_t ldy, int64_t n) {
  using F = typename V::F;
  constexpr int C = 2 * V::W;
  F ae[M][U], ao[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) ae[m][u] = ao[m][u] = V::zero();
  const uint16_t* wr = w + n * K;
  int64_t k = 0;
  for (; k + C * U <= K; k += C * U) {
    // The weight prefetch of the kind the loader measured for this model (stream_hint.h), once per 64-byte line.
    constexpr int kPerLine = C >= 32 ? 1 : 32 / C;  // chunks per 64-byte line
    for (int u = 0; u < U; u += kPerLine) prefetch_stream<kStreamBf16>(wr + k + C * u);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      F we, wo;
      V::widen(wr + k + C * u, we, wo);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const float* xm = xs + m * KC + k + C * u;
        ae[m][u] = V::fma(we, V::load(xm), ae[m][u]);
        ao[m][u] = V::fma(wo, V::load(xm + V::W), ao[m][u]);
      }
    }
  }
  for (; k < K; k += C) {  // the rest, a chunk at a time; a partial last chunk is copied out (x is zero there)
    alignas(64) uint16_t tmp[C] = {0};
    const uint16_t* src = wr + k;
    if (K - k < C) {
      std::memcpy(tmp, wr + k, (K - k) * 2);
      src = tmp;
    }
    F we, wo;
    V::widen(src, we, wo);
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + m * KC + k;
      ae[m][0] = V::fma(we, V::load(xm), ae[m][0]);
      ao[m][0] = V::fma(wo, V::load(xm + V::W), ao[m][0]);
    }
  }
  for (int m = 0; m < M; ++m) {
    F s = V::add(ae[m][0], ao[m][0]);
    for (int u = 1; u < U; ++u) s = V::add(s, V::add(ae[m][u], ao[m][u]));
    y[m * ldy + n] = c10::BFloat16(V::sum(s) + (bias ? bias[n] : 0.f)).x;
  }
}

// Rows m0 .. m0 + M of the output, for weight rows n0 .. n1.
template <typename V, int M, int U>
void columns(const float* xs, int64_t KC, const uint16_t* w, int64_t K, const float* bias, uint16_t* y, int64_t ldy,
             int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) column<V, M, U>(xs, KC, w, K, bias, y, ldy, n);
}

// One group of g <= V::kGroup activation rows over weight rows n0 .. n1: unrolled by U so that about 8
// (AVX2) or 16 (AVX-512) accumulators are live.
template <typename V>
void group(int64_t g, const float* xs, int64_t KC, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
           int64_t ldy, int64_t n0, int64_t n1) {
  switch (g) {
    case 1: columns<V, 1, 4>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
    case 2: columns<V, 2, 2>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
    case 3: columns<V, 3, 1>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
    case 4: columns<V, 4, 1>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
    default:
      if constexpr (V::kGroup >= 8) {
        switch (g) {
          case 5: columns<V, 5, 1>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
          case 6: columns<V, 6, 1>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
          case 7: columns<V, 7, 1>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
          default: columns<V, 8, 1>(xs, KC, w, K, bias, y, ldy, n0, n1); break;
        }
      }
      break;
  }
}

// x [M, K] -> y [M, N] (the caller checked the shapes).
void linear(const torch::Tensor& x, const torch::Tensor& w, const float* bp, torch::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  constexpr int C = 2 * Vec::W, G = Vec::kGroup;
  const int64_t KC = (K + C - 1) / C * C;
  // The widened activations: on the stack for the usual sizes.
  std::vector<float> xs_heap;
  alignas(64) float xs_stack[8 * 2048];
  float* xs = M * KC <= 8 * 2048 ? xs_stack : (xs_heap.resize(M * KC), xs_heap.data());
  widen_split<C>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), M, K, xs, KC);
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  parallel_rows(N, [&](int64_t n0, int64_t n1) {
    // Groups of at most G activation rows, over a block of kRows weight rows at a time: past one group each
    // weight row is read again for the next, from L1. (Group by group over the thread's whole share of N, as
    // this had been, streamed the weights from memory once per group: 4 times at 16 rows.)
    constexpr int64_t kRows = 8;
    for (int64_t b0 = n0; b0 < n1; b0 += kRows) {
      const int64_t b1 = std::min(n1, b0 + kRows);
      for (int64_t m0 = 0; m0 < M; m0 += G)
        group<Vec>(std::min<int64_t>(G, M - m0), xs + m0 * KC, KC, wp, K, bp, yp + m0 * N, N, b0, b1);
    }
  });
}

}  // namespace widen

#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define LEVERLAB_SKINNY_DPBF16 1

namespace dpbf16 {

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Each weight line's software prefetch is of the kind the loader measured for this model (stream_hint.h's
// prefetch_as, the kind a template argument, chosen once per call in linear() below); the T0 kind runs `Prefetch`
// elements ahead (the distance of a sweep per row count, made on a Xeon where T0 prefetches paid). Why the kind is
// measured here too: on a Zen 4 (a standalone pass over the Qwen3-0.6B shape's 113 matrices, two
// threads, 8 interleaved rounds, median) one row read at 42 GB/s with T0 2 KB ahead, 40-42 with nta and 48-50
// with no software prefetch at all, beside 43-47 for a plain read loop.
// Output column n for M activation rows: the dot products of row n of W with each row of x. U independent
// accumulators per activation row (chunks k, k + 32, ... k + 32 (U - 1)) hide dpbf16ps's latency when M is
// small; M * U <= 8 keeps them in registers (gcc spilled larger accumulator arrays and halved the rate).
template <int Mode, int M, int U, int64_t Prefetch>
inline void column(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
                   int64_t ldy, int64_t n) {
  __m512 acc[M][U];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  const uint16_t* wr = w + n * K;
  int64_t k = 0;
  if constexpr (U > 1) {
    for (; k + 32 * U <= K; k += 32 * U) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        prefetch_as<Mode, 2 * Prefetch>(wr + k + 32 * u);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32 * u), wv);
      }
    }
  }
  for (; k < K; k += 32) {  // U == 1: the whole row; otherwise the tail (masked past K)
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    prefetch_as<Mode, 2 * Prefetch>(wr + k);
    const __m512bh wv = load_bf16(wr + k, mask);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], load_bf16(x + m * ldx + k, mask), wv);
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    __m512 s = acc[m][0];
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
    y[m * ldy + n] = c10::BFloat16(_mm512_reduce_add_ps(s) + (bias ? bias[n] : 0.f)).x;
  }
}

// Output columns n and n + 1 for M activation rows: each activation chunk loaded once for two weight rows, so
// that a chunk's 2 M dot products take M + 2 loads (column<> takes 2 M for them). 2 M <= 16 accumulators.
// Its weights are prefetched into L2 kPairsL2Ahead bytes ahead (rows_upto8 says why).
constexpr int64_t kPairsL2Ahead = 16384;
template <int M>
inline void column_pair(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
                        int64_t ldy, int64_t n) {
  __m512 a0[M], a1[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  const uint16_t* w0 = w + n * K;
  const uint16_t* w1 = w0 + K;
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    prefetch_as<kPrefetchL2, kT0Ahead, kPairsL2Ahead>(w0 + k);
    prefetch_as<kPrefetchL2, kT0Ahead, kPairsL2Ahead>(w1 + k);
    const __m512bh v0 = load_bf16(w0 + k, mask), v1 = load_bf16(w1 + k, mask);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16(x + m * ldx + k, mask);
      a0[m] = _mm512_dpbf16_ps(a0[m], xv, v0);
      a1[m] = _mm512_dpbf16_ps(a1[m], xv, v1);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    y[m * ldy + n] = c10::BFloat16(_mm512_reduce_add_ps(a0[m]) + (bias ? bias[n] : 0.f)).x;
    y[m * ldy + n + 1] = c10::BFloat16(_mm512_reduce_add_ps(a1[m]) + (bias ? bias[n + 1] : 0.f)).x;
  }
}

template <int M>
void column_pairs(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t n0, int64_t n1, int64_t K,
                  const float* bias, uint16_t* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) column_pair<M>(x, ldx, w, K, bias, y, ldy, n);
  if (n < n1) column<kPrefetchL2, M, 1, 4096>(x, ldx, w, K, bias, y, ldy, n);
}

template <int Mode, int M, int U, int64_t Prefetch>
void columns(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t n0, int64_t n1, int64_t K, const float* bias,
             uint16_t* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) column<Mode, M, U, Prefetch>(x, ldx, w, K, bias, y, ldy, n);
}

// Weight rows n0 .. n1 for M <= 8 activation rows: up to 4 rows one weight row at a time, with the unrolling and
// prefetch distance (elements) of the best of a sweep per row count (scripts/bench_linear.py); from 5 rows on
// weight rows in pairs (column_pair: 1.06-1.16x at 6-16 rows on the Qwen3-0.6B shape's matrices, two threads,
// a Xeon).
// The measured prefetch mode governs up to 3 rows, where the step is a memory stream. From 4 rows on the loop
// has enough arithmetic per line that it and the memory stream take turns unless the lines are asked for well
// ahead, and a prefetch into L2 (PREFETCHT1) does that where T0, NTA and the hardware prefetchers alone did not:
// on a Zen 4 (bf16 0.6B shape, two threads, whole decodes in one process with the kinds alternating,
// paired medians of 6) sixteen sequences decoded 1.23x faster with L2 16 KB ahead than with T0 8 KB ahead (the
// kind here before; 32 KB: 1.26x, PREFETCHT2 16 KB: 1.19x), eight 1.40x (L2 32 KB ahead), four 1.36x (L2 4 KB
// ahead against the measured mode, off); but three 0.95x and two 0.82x, so those keep the mode. A standalone pass
// over the shape's matrices (16 rows, two threads) agreed: 44 ms with T0 8 KB ahead, 31-34 with L2 16-32 KB
// ahead, 41 with none. (The int8 and int4 tiles did not gain from it: 0.97x and 0.96x at sixteen sequences.)
template <int Mode>
void rows_upto8(int64_t M, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t n0, int64_t n1, int64_t K,
                const float* bias, uint16_t* y, int64_t ldy) {
  switch (M) {
    case 1: columns<Mode, 1, 4, 1024>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    case 2: columns<Mode, 2, 4, 1024>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    case 3: columns<Mode, 3, 2, 1024>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    case 4: columns<kPrefetchL2, 4, 2, 1024>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    case 5: column_pairs<5>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    case 6: column_pairs<6>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    case 7: column_pairs<7>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
    default: column_pairs<8>(x, ldx, w, n0, n1, K, bias, y, ldy); break;
  }
}

// x [M, K] -> y [M, N], M <= 8 (the caller checked the shapes), in prefetch mode Mode.
template <int Mode>
void linear_as(const uint16_t* xp, int64_t ldx, const uint16_t* wp, int64_t M, int64_t N, int64_t K, const float* bias,
               uint16_t* yp) {
  parallel_rows(N, [&](int64_t n0, int64_t n1) {
    if (M <= 8) return rows_upto8<Mode>(M, xp, ldx, wp, n0, n1, K, bias, yp, N);
    // More rows: groups of 8 over blocks of kRows weight rows, so that past the first group each weight row is
    // read again from L1, not memory (group by group over the whole share would stream W once per group).
    constexpr int64_t kRows = 8;
    for (int64_t b0 = n0; b0 < n1; b0 += kRows)
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_upto8<Mode>(std::min<int64_t>(8, M - m0), xp + m0 * ldx, ldx, wp, b0, std::min(n1, b0 + kRows), K, bias,
                         yp + m0 * N, N);
  });
}

// x [M, K] -> y [M, N] (the caller checked the shapes).
void linear(const torch::Tensor& x, const torch::Tensor& w, const float* bias, torch::Tensor& y) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  switch (stream_prefetch_mode(kStreamBf16)) {
    case kPrefetchOff: return linear_as<kPrefetchOff>(xp, x.stride(0), wp, M, N, K, bias, yp);
    case kPrefetchNonTemporal: return linear_as<kPrefetchNonTemporal>(xp, x.stride(0), wp, M, N, K, bias, yp);
    case kPrefetchL2: return linear_as<kPrefetchL2>(xp, x.stride(0), wp, M, N, K, bias, yp);
    default: return linear_as<kPrefetchAhead>(xp, x.stride(0), wp, M, N, K, bias, yp);
  }
}

}  // namespace dpbf16

#endif

// Rows are taken in groups (4 with AVX2, 8 with AVX-512 or AVX-512 BF16), each weight row re-read from L1 for the
// next group, so past a few rows the kernel is a compute-bound GEMM; it stays ahead of aten's bf16 GEMM up to this
// many (with AVX-512 BF16: 1.2x oneDNN's at 16 rows, 1.0x at 32; scripts/bench_linear.py).
#if LEVERLAB_SKINNY_WIDEN  // (AVX-512 BF16 implies AVX2 + FMA)
bool has_skinny_linear() { return true; }
int64_t skinny_max_rows() { return 32; }
#else  // no AVX2: callers check has_skinny_linear() and keep aten's linear
bool has_skinny_linear() { return false; }
int64_t skinny_max_rows() { return 0; }
#endif

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "skinny_linear: bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "skinny_linear: contiguous rows");
  TORCH_CHECK(has_skinny_linear(), "skinny_linear needs AVX-512 BF16 or AVX2 + FMA");
  const int64_t M = x.size(0), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= skinny_max_rows(), "skinny_linear: 1..", skinny_max_rows(), " rows");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  const float* bp = bias_f32(bias, b32);
#if LEVERLAB_SKINNY_DPBF16
  // vdpbf16ps where the machine has it. (On a Sapphire/Emerald Rapids core it issues every other cycle, 43 GMAC/s
  // measured, where two FMA ports could do 82; but the widening kernel below ran 0.5-0.6x as fast there at 8-16
  // rows, bound by its activation loads, so it is kept for machines without AVX-512 BF16.)
  dpbf16::linear(x, w, bp, y);
#elif LEVERLAB_SKINNY_WIDEN
  widen::linear(x, w, bp, y);
#endif
  return y;
}


bool amx_bf16_takes(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor amx_bf16_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);

// The op that models call (leverlab_cpu::linear_bf16): on AMX tiles where the CPU has them (amx_bf16.cpp: 1..32 rows,
// K a multiple of 32), else our streaming kernel for 1..skinny_max_rows() contiguous rows, aten's linear for
// anything else (prefill chunks, larger batches). Registered with the dispatcher in C++ so that a call costs
// about a microsecond: the same op defined in Python cost ~8 us per call, ~0.8 ms of a 0.6B decode step.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
  if (bf16 && amx_bf16_takes(x, w)) return amx_bf16_linear(x, w, bias);
  if (bf16 && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= skinny_max_rows() && x.stride(1) == 1 && w.is_contiguous())
    return skinny_linear(x, w, bias);
#if !defined(__AVX512BF16__)
  // Without AVX-512 BF16, aten's bf16 GEMM is emulated: widening both operands and taking the float32 GEMM was
  // 3-8x faster for 64-512 rows (prefill chunks) on a Zen 3, the widening included.
  if (bf16) {
    c10::optional<torch::Tensor> b32;
    if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat);
    return at::linear(x.to(at::kFloat), w.to(at::kFloat), b32).to(at::kBFloat16);
  }
#endif
  return at::linear(x, w, bias);
}

TORCH_LIBRARY(leverlab_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(leverlab_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}
