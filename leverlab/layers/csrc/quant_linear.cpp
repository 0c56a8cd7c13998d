// y = (x W^T) * s (+ b) for int8 weights W [N, K] with one float32 scale per output row, for a few rows of x.
//
// Weight-only: the activations stay in their dtype (widened to float32 once per call), each 16-weight chunk is
// widened in registers (sign-extend, convert) and multiplied in float32, and the row's scale is applied once to
// the finished dot product. Like the bf16 kernel (skinny_linear.cpp) each thread walks its share of W's rows as
// one sequential stream: decode reads W once, so the kernel's job is to keep up with memory at one byte a weight.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The dot products of weight row n with M activation rows (float32, K16 apart, zero-padded to K16), M <= 4:
// two accumulators per row (the two 8-weight halves of a chunk) keep 2M FMA chains in flight.
template <int M, int U>
inline void row_dots(const float* xs, int64_t K16, const int8_t* wr, int64_t K, float* dots) {
  __m256 acc[M][2 * U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < 2 * U; ++u) acc[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + k + 1024), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m128i wv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16 * u));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(wv));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(wv, wv)));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const float* xm = xs + m * K16 + k + 16 * u;
        acc[m][2 * u] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m][2 * u]);
        acc[m][2 * u + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m][2 * u + 1]);
      }
    }
  }
  for (; k < K; k += 16) {  // the rest; a partial chunk is copied out (x is zero past K)
    alignas(16) int8_t tmp[16] = {0};
    std::memcpy(tmp, wr + k, std::min<int64_t>(16, K - k));
    const __m128i wv = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(wv));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(wv, wv)));
    for (int m = 0; m < M; ++m) {
      const float* xm = xs + m * K16 + k;
      acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 s = acc[m][0];
    for (int u = 1; u < 2 * U; ++u) s = _mm256_add_ps(s, acc[m][u]);
    dots[m] = hsum8(s);
  }
}
#endif

template <typename T>
void int8_rows(const at::Tensor& x, const int8_t* w, const float* scale, const float* bias, T* y, int64_t N,
               int64_t K) {
  const int64_t M = x.size(0), K16 = (K + 15) / 16 * 16;
  std::vector<float> xs(M * K16, 0.f);  // the activations in float32, zero past K
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data_ptr<T>() + m * x.stride(0);
    for (int64_t k = 0; k < K; ++k) xs[m * K16 + k] = static_cast<float>(xr[k]);
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float dots[4];
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {  // groups of 4 rows; a weight row is re-read from L1
        const int64_t g = std::min<int64_t>(4, M - m0);
        const float* xg = xs.data() + m0 * K16;
#if defined(__AVX2__) && defined(__FMA__)
        switch (g) {
          case 1: row_dots<1, 2>(xg, K16, wr, K, dots); break;
          case 2: row_dots<2, 1>(xg, K16, wr, K, dots); break;
          case 3: row_dots<3, 1>(xg, K16, wr, K, dots); break;
          default: row_dots<4, 1>(xg, K16, wr, K, dots); break;
        }
#else
        for (int64_t m = 0; m < g; ++m) {
          float s = 0.f;
          for (int64_t k = 0; k < K; ++k) s += static_cast<float>(wr[k]) * xg[m * K16 + k];
          dots[m] = s;
        }
#endif
        for (int64_t m = 0; m < g; ++m) y[(m0 + m) * N + n] = static_cast<T>(dots[m] * scale[n] + (bias ? bias[n] : 0.f));
      }
    }
  });
}

}  // namespace

// x [M, K] (float32 / bf16 / fp16), w [N, K] int8, scale [N] float32, bias [N] or none -> [M, N] in x's dtype.
// Our streaming kernel for up to 8 rows; above that, aten's matmul on the dequantized weight.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_linear: contiguous int8 weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "int8_linear: float32 scale [N]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (M > 8 || x.stride(1) != 1) {
    at::Tensor y = at::mm(x, w.t().to(x.scalar_type())) * scale.to(x.scalar_type());
    return bias.has_value() && bias->defined() ? y + *bias : y;
  }
  auto y = at::empty({M, N}, x.options());
  at::Tensor b32;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b32 = bias->to(at::kFloat).contiguous();
    bp = b32.data_ptr<float>();
  }
  auto sc = scale.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    int8_rows<scalar_t>(x, w.data_ptr<int8_t>(), sc.data_ptr<float>(), bp, y.data_ptr<scalar_t>(), N, K);
  });
  return y;
}

// ---- int4: W ~= q * s - s * z per group of g input channels (q, z in 0..15), packed two to a byte.
// Layout (quant/int4.py: pack_int4_fused): per 32-weight block of a row, 16 bytes; byte i holds weight i in its
// low nibble and weight 16 + i in its high one, so the two nibble planes widen in order with no shuffles.
// A group's dot product is s * sum(q x) - s z * sum(x): the zero point costs one term per group, with the
// group sums of x computed once per call.

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// sum over one 32-weight block of q[i] * x[i], into 4 accumulators.
inline void block32(const uint8_t* b, const float* x, __m256& a0, __m256& a1, __m256& a2, __m256& a3) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(x), a0);
  a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), a1);
  a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(x + 16), a2);
  a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), a3);
}
#endif

inline float q_dot(const uint8_t* b, const float* x, int64_t n) {  // n weights (a multiple of 32)
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < n; k += 32) block32(b + k / 2, x + k, a0, a1, a2, a3);
  return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float s = 0.f;
  for (int64_t k = 0; k < n; k += 32)
    for (int i = 0; i < 16; ++i)
      s += static_cast<float>(b[k / 2 + i] & 15) * x[k + i] + static_cast<float>(b[k / 2 + i] >> 4) * x[k + 16 + i];
  return s;
#endif
}

template <typename T>
void int4_rows(const at::Tensor& x, const uint8_t* w, const float* s, const float* sz, int64_t g, const float* bias,
               T* y, int64_t N, int64_t K) {
  const int64_t M = x.size(0), G = K / g;
  std::vector<float> xs(M * K), xsum(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data_ptr<T>() + m * x.stride(0);
    for (int64_t k = 0; k < K; ++k) {
      xs[m * K + k] = static_cast<float>(xr[k]);
      xsum[m * G + k / g] += xs[m * K + k];
    }
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * (K / 2);
      __builtin_prefetch(wr + 2048);
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t j = 0; j < G; ++j)
          acc += s[n * G + j] * q_dot(wr + j * g / 2, xs.data() + m * K + j * g, g) - sz[n * G + j] * xsum[m * G + j];
        y[m * N + n] = static_cast<T>(acc + (bias ? bias[n] : 0.f));
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// bf16/fp16 activations, as llama.cpp's q4_0 x q8_0: the activations are quantized to int8 per 32-element block
// (scale max|x| / 127, one rounding of at most half a step), and a block's 32 products are integer multiply-adds
// (vpmaddubsw: unsigned nibble x signed int8, pair sums <= 2 * 15 * 127, no saturation; then vpmaddwd), about
// 8 instructions per 32 weights against 17 for widening to float. One float FMA per block applies s_w * s_x.
// The zero point's term s z sum(x) uses the quantized x's block sums, so the result is exactly that of the
// dequantized weight times the quantized activations.
// Row n's dot products with activation rows r0 .. r0 + MG (a compile-time count keeps the accumulators in
// registers); returns them without the zero-point term.
template <int MG>
inline void q8_dots(const uint8_t* wr, const float* s_row, int64_t bpg, const int8_t* xq, const float* xsc,
                    int64_t K, int64_t B, int64_t r0, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[MG];
  for (int m = 0; m < MG; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + b * 16));
    const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
    const float ws = s_row[b / bpg];
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m) {
      const int64_t r = r0 + m;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * 32));
      const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), ones));
      acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(ws * xsc[r * B + b]), acc[m]);
    }
  }
  for (int m = 0; m < MG; ++m) out[m] = hsum8(acc[m]);
}

template <typename T>
void int4_rows_q8(const at::Tensor& x, const uint8_t* w, const float* s, const float* sz, int64_t g,
                  const float* bias, T* y, int64_t N, int64_t K) {
  const int64_t M = x.size(0), G = K / g, B = K / 32, bpg = g / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xsc(M * B), gsum(M * G, 0.f);  // block scales; per group, the sum of the quantized x
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data_ptr<T>() + m * x.stride(0);
    for (int64_t b = 0; b < B; ++b) {
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(static_cast<float>(xr[b * 32 + i])));
      const float sc = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t isum = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(static_cast<float>(xr[b * 32 + i]) * inv));
        xq[m * K + b * 32 + i] = static_cast<int8_t>(v);
        isum += v;
      }
      xsc[m * B + b] = sc;
      gsum[m * G + b / bpg] += sc * static_cast<float>(isum);
    }
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float dots[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * (K / 2);
      __builtin_prefetch(wr + 2048);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {  // groups of 4 rows; the weight row is re-read from L1
        const int64_t mg = std::min<int64_t>(4, M - m0);
        switch (mg) {
          case 1: q8_dots<1>(wr, s + n * G, bpg, xq.data(), xsc.data(), K, B, m0, dots); break;
          case 2: q8_dots<2>(wr, s + n * G, bpg, xq.data(), xsc.data(), K, B, m0, dots); break;
          case 3: q8_dots<3>(wr, s + n * G, bpg, xq.data(), xsc.data(), K, B, m0, dots); break;
          default: q8_dots<4>(wr, s + n * G, bpg, xq.data(), xsc.data(), K, B, m0, dots); break;
        }
        for (int64_t m = 0; m < mg; ++m) {
          const int64_t r = m0 + m;
          float zterm = 0.f;
          for (int64_t j = 0; j < G; ++j) zterm += sz[n * G + j] * gsum[r * G + j];
          y[r * N + n] = static_cast<T>(dots[m] - zterm + (bias ? bias[n] : 0.f));
        }
      }
    }
  });
}
#endif

}  // namespace

// x [M, K], packed [N, K / 2] uint8 (the layout above), scales and scaled zeros (s * z) [N, K / g] float32 ->
// [M, N] in x's dtype. Up to 8 rows stream; more rows dequantize the weight and take aten's matmul. float32
// activations are used as they are (exact against the dequantized weight); bf16/fp16 ones, with AVX2, are
// quantized to int8 per 32-block for integer dot products (int4_rows_q8).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& szeros, int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) == 2 * packed.size(1), "int4_linear: x [M, K], w [N, K/2]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "int4_linear: contiguous uint8 weight");
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "int4_linear: the group size is a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && szeros.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  szeros.is_contiguous() && scales.numel() == N * (K / group) && szeros.numel() == scales.numel(),
              "int4_linear: float32 scales and scaled zeros [N, K / group]");
  at::Tensor b32;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b32 = bias->to(at::kFloat).contiguous();
    bp = b32.data_ptr<float>();
  }
  if (M > 8 || x.stride(1) != 1) {
    auto p = packed.view({N, K / 32, 16});
    auto q = at::cat({at::bitwise_and(p, 15), at::bitwise_right_shift(p, 4)}, 2).view({N, K}).to(at::kFloat);
    auto w = (q.view({N, K / group, group}) * scales.view({N, K / group, 1}) - szeros.view({N, K / group, 1}));
    at::Tensor y = at::mm(x.to(at::kFloat), w.view({N, K}).t());
    if (bp) y = y + b32;
    return y.to(x.scalar_type());
  }
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_linear", [&] {
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (!std::is_same_v<scalar_t, float> && !std::is_same_v<scalar_t, double>) {
      int4_rows_q8<scalar_t>(x, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), szeros.data_ptr<float>(), group,
                             bp, y.data_ptr<scalar_t>(), N, K);
      return;
    }
#endif
    int4_rows<scalar_t>(x, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), szeros.data_ptr<float>(), group, bp,
                        y.data_ptr<scalar_t>(), N, K);
  });
  return y;
}
