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
#include <ATen/Parallel.h>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

bool has_skinny_linear() { return true; }

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
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b32 = bias->to(at::kFloat).contiguous();
    bp = b32.data_ptr<float>();
  }
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

// The op that models call (leverlab_cpu::linear_bf16): our kernel for 1..8 contiguous rows, aten's linear for
// anything else (prefill chunks, larger batches). Registered with the dispatcher in C++ so that a call costs
// about a microsecond: the same op defined in Python cost ~8 us per call, ~0.8 ms of a 0.6B decode step.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  if (x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8 && x.stride(1) == 1 && w.is_contiguous() &&
      x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16)
    return skinny_linear(x, w, bias);
  return at::linear(x, w, bias);
}

TORCH_LIBRARY(leverlab_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(leverlab_cpu, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}

#else  // a CPU without AVX-512 BF16: callers check has_skinny_linear() and keep aten's linear

bool has_skinny_linear() { return false; }

torch::Tensor skinny_linear(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "skinny_linear needs AVX-512 BF16");
}

#endif
