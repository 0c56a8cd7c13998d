// y = x W^T (+ b) for a few rows of x, in bfloat16, with AVX-512 BF16 dot products.
//
// Decode multiplies 1..8 activation rows by every weight matrix: the work is reading W once, so the kernel is
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
#include "stream_hint.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

bool has_skinny_linear() { return true; }
int64_t skinny_max_rows() { return 8; }

namespace {

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Output column n for M activation rows: the dot products of row n of W with each row of x. U independent
// accumulators per activation row (chunks k, k + 32, ... k + 32 (U - 1)) hide dpbf16ps's latency when M is
// small; M * U <= 8 keeps them in registers (gcc spilled larger accumulator arrays and halved the rate).
// The prefetch distance, in elements, runs ahead of the hardware prefetcher within and across rows.
template <int M, int U, int64_t Prefetch>
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
        _mm_prefetch(reinterpret_cast<const char*>(wr + k + 32 * u + Prefetch), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32 * u), wv);
      }
    }
  }
  for (; k < K; k += 32) {  // U == 1: the whole row; otherwise the tail (masked past K)
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    _mm_prefetch(reinterpret_cast<const char*>(wr + k + Prefetch), _MM_HINT_T0);
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

template <int M, int U, int64_t Prefetch>
void run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t N, int64_t K, const float* bias, uint16_t* y,
         int64_t ldy) {
  // Contiguous shares of 64 rows or more: one sequential stream per thread, balanced across 2..16 threads.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) column<M, U, Prefetch>(x, ldx, w, K, bias, y, ldy, n);
  });
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "skinny_linear: bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "skinny_linear: contiguous rows");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(M >= 1 && M <= 8, "skinny_linear: 1..8 rows");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  // Unrolling and prefetch distance (elements) per row count: the best of a sweep (scripts/bench_linear.py).
  switch (M) {
    case 1: run<1, 4, 1024>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 2: run<2, 4, 1024>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 3: run<3, 2, 1024>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 4: run<4, 2, 1024>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 5: run<5, 1, 4096>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 6: run<6, 1, 4096>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 7: run<7, 1, 4096>(xp, ldx, wp, N, K, bp, yp, N); break;
    default: run<8, 1, 4096>(xp, ldx, wp, N, K, bp, yp, N); break;
  }
  return y;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SKINNY_AVX2_MAX_ROWS 32

// AVX2 + FMA (Zen 2/3, Haswell and later): no bf16 dot product, so the kernel widens the weights to float32 in
// registers. A 32-bit lane holding bf16 elements (2i, 2i+1) gives element 2i+1 as a float by masking off the low
// half and element 2i by shifting it left 16: two integer ops per 16 weights, no shuffles. The activations are
// widened once per call into that same order (even elements, then odd, per 16-element chunk), so each 16-weight
// chunk costs one load, two integer ops and 2 * M FMAs, and stays ahead of one core's memory stream.

bool has_skinny_linear() { return true; }
// Rows are taken 4 at a time, each weight row re-read from L1 for the next 4, so past a few rows the kernel is
// a compute-bound GEMM; it stays ahead of aten's bf16 GEMM (emulated without AVX-512 BF16) up to this many.
int64_t skinny_max_rows() { return SKINNY_AVX2_MAX_ROWS; }

namespace {

// x [M, K] bf16 -> xs [M, K16] float32, K16 = K rounded up to 16: per chunk of 16, the 8 even elements then the
// 8 odd ones (zero past K, so the masked tail of a weight row adds nothing).
void widen_split(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* xs, int64_t K16) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * ldx;
    float* d = xs + m * K16;
    for (int64_t c = 0; c < K16; c += 16)
      for (int j = 0; j < 8; ++j) {
        const int64_t e = c + 2 * j, o = e + 1;
        uint32_t be = e < K ? static_cast<uint32_t>(xr[e]) << 16 : 0u, bo = o < K ? static_cast<uint32_t>(xr[o]) << 16 : 0u;
        std::memcpy(d + c + j, &be, 4);
        std::memcpy(d + c + 8 + j, &bo, 4);
      }
  }
}

// Output column n for M activation rows (M <= 4): U chunks of 16 in flight, even and odd halves in separate
// accumulators, so M * U * 2 <= 8 independent FMA chains cover the FMA latency without spilling.
template <int M, int U>
inline void column(const float* xs, int64_t K16, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
                   int64_t ldy, int64_t n) {
  __m256 ae[M][U], ao[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) ae[m][u] = ao[m][u] = _mm256_setzero_ps();
  const uint16_t* wr = w + n * K;
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    // Non-temporal prefetch 1 KB ahead (stream_hint.h): the weights, read once per step, stay out of the caches
    // that hold everything else. A T0 prefetch measured 3-5% slower than none; NTA 8-20% faster per decode step.
    for (int u = 0; u < U; u += 2) prefetch_stream(wr + k + 16 * u + kStreamAhead / 2);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      __m256 we, wo;
      widen_bf16x16(wr + k + 16 * u, we, wo);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const float* xm = xs + m * K16 + k + 16 * u;
        ae[m][u] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xm), ae[m][u]);
        ao[m][u] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xm + 8), ao[m][u]);
      }
    }
  }
  for (; k < K; k += 16) {  // the rest, 16 at a time; a partial last chunk is copied out (x is zero there)
    alignas(32) uint16_t tmp[16] = {0};
    const uint16_t* src = wr + k;
    if (K - k < 16) {
      std::memcpy(tmp, wr + k, (K - k) * 2);
      src = tmp;
    }
    __m256 we, wo;
    widen_bf16x16(src, we, wo);
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + m * K16 + k;
      ae[m][0] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xm), ae[m][0]);
      ao[m][0] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xm + 8), ao[m][0]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 s = _mm256_add_ps(ae[m][0], ao[m][0]);
    for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, _mm256_add_ps(ae[m][u], ao[m][u]));
    y[m * ldy + n] = c10::BFloat16(hsum8(s) + (bias ? bias[n] : 0.f)).x;
  }
}

// Rows m0 .. m0 + M of the output, for weight rows n0 .. n1.
template <int M, int U>
void columns(const float* xs, int64_t K16, const uint16_t* w, int64_t K, const float* bias, uint16_t* y, int64_t ldy,
             int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) column<M, U>(xs, K16, w, K, bias, y, ldy, n);
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "skinny_linear: bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "skinny_linear: contiguous rows");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(M >= 1 && M <= skinny_max_rows(), "skinny_linear: 1..", skinny_max_rows(), " rows");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  const int64_t K16 = (K + 15) / 16 * 16;
  // The widened activations: at most 8 x K floats, on the stack for the usual sizes.
  std::vector<float> xs_heap;
  alignas(64) float xs_stack[8 * 2048];
  float* xs = M * K16 <= 8 * 2048 ? xs_stack : (xs_heap.resize(M * K16), xs_heap.data());
  widen_split(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), M, K, xs, K16);
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    // Groups of at most 4 activation rows (8 accumulators), over a block of kRows weight rows at a time: past 4
    // rows each weight row is read again for the next group, from L1. (Group by group over the thread's whole
    // share of N, as this had been, streamed the weights from memory once per group: 4 times at 16 rows.)
    constexpr int64_t kRows = 8;
    for (int64_t b0 = n0; b0 < n1; b0 += kRows) {
      const int64_t b1 = std::min(n1, b0 + kRows);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xg = xs + m0 * K16;
        uint16_t* yg = yp + m0 * N;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: columns<1, 4>(xg, K16, wp, K, bp, yg, N, b0, b1); break;
          case 2: columns<2, 2>(xg, K16, wp, K, bp, yg, N, b0, b1); break;
          case 3: columns<3, 1>(xg, K16, wp, K, bp, yg, N, b0, b1); break;
          default: columns<4, 1>(xg, K16, wp, K, bp, yg, N, b0, b1); break;
        }
      }
    }
  });
  return y;
}

#else  // neither AVX-512 BF16 nor AVX2: callers check has_skinny_linear() and keep aten's linear

bool has_skinny_linear() { return false; }
int64_t skinny_max_rows() { return 0; }

torch::Tensor skinny_linear(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "skinny_linear needs AVX-512 BF16 or AVX2 + FMA");
}

#endif

// The op that models call (leverlab_cpu::linear_bf16): our kernel for 1..skinny_max_rows() contiguous rows, aten's linear for
// anything else (prefill chunks, larger batches). Registered with the dispatcher in C++ so that a call costs
// about a microsecond: the same op defined in Python cost ~8 us per call, ~0.8 ms of a 0.6B decode step.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
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
