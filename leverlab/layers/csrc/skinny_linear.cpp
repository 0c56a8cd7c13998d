// y = x W^T (+ b) for a few rows of x, in bfloat16, with AVX-512 BF16 dot products.
//
// Decode multiplies 1..8 activation rows by every weight matrix: the work is reading W once, so the kernel is
// a streaming loop over W's rows that keeps several rows in flight (memory-level parallelism) and applies each
// 32-element weight chunk to every activation row while it is in registers. Accumulation is fp32 (dpbf16ps
// multiplies bf16 pairs exactly and adds in fp32); each output is rounded to bf16 once, as aten's linear does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

bool has_skinny_linear() { return true; }

namespace {

// Software prefetch distance, in weight elements (8 KB ahead on each streamed row). The hardware prefetcher
// alone kept too few misses in flight with 2..4 streamed rows: measured on one core over a 0.9 GB stack
// (scripts/bench_linear.py), 2 and 4 activation rows went from 18.5 and 12.8 GB/s to 23.7 and 24.8 GB/s.
// Prefetching past a row's end is harmless (prefetches never fault).
constexpr int64_t kPrefetch = 4096;

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// M activation rows times exactly R weight rows starting at row n. All bounds are compile-time so that the
// M * R accumulators (<= 24 of 32 zmm registers) stay in registers; a runtime bound made gcc spill them.
template <int M, int R>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
                 int64_t ldy, int64_t n) {
  __m512 acc[M][R];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r) * K + k + kPrefetch), _MM_HINT_T0);
      wv[r] = load_bf16(w + (n + r) * K + k, mask);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16(x + m * ldx + k, mask);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      y[m * ldy + n + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n + r] : 0.f)).x;
}

template <int M, int R>
void block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const float* bias, uint16_t* y,
           int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<M, R>(x, ldx, w, K, bias, y, ldy, n);
  for (; n < n1; ++n) tile<M, 1>(x, ldx, w, K, bias, y, ldy, n);
}

template <int M, int R>
void run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t N, int64_t K, const float* bias, uint16_t* y,
         int64_t ldy) {
  // Blocks of 64 weight rows per task: large enough to stream, small enough to balance 2..16 threads.
  const int64_t chunk = 64;
  at::parallel_for(0, (N + chunk - 1) / chunk, 1, [&](int64_t b0, int64_t b1) {
    block<M, R>(x, ldx, w, K, bias, y, ldy, b0 * chunk, std::min(N, b1 * chunk));
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
  // M * R = 8 accumulators at most: beyond that gcc keeps the accumulator array in memory and stores
  // every one of them on each iteration (seen in the assembly), which halves the streaming rate.
  switch (M) {
    case 1: run<1, 8>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 2: run<2, 4>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 3: run<3, 2>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 4: run<4, 2>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 5: run<5, 1>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 6: run<6, 1>(xp, ldx, wp, N, K, bp, yp, N); break;
    case 7: run<7, 1>(xp, ldx, wp, N, K, bp, yp, N); break;
    default: run<8, 1>(xp, ldx, wp, N, K, bp, yp, N); break;
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
