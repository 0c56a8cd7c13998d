// Small math helpers in forms the compiler vectorizes (std::exp does not), shared by the kernels.
#pragma once
#include <cstdint>
#include <cstring>

// exp(x) for the x <= 0 of a softmax, in a form that vectorizes (std::exp does not): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (relative error ~1e-7), 2^n put into the exponent bits.
// Below -87 the result is clamped to ~1.6e-38 instead of underflowing: nothing next to a sum of at least 1.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts, so r stays exact
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// exp_nonpositive, eight at a time (the same range reduction and polynomial).
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
// Lane i of the result: the sum of a[i]'s 16 lanes, for 16 vectors at once (45 shuffles and adds where 16
// horizontal sums take ~12 each). The single-stream linears reduce 16 weight rows with it, decode attention 16
// positions' scores.
inline __m512 hsum16(const __m512* a) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a[2i]'s and a[2i+1]'s pair sums, interleaved
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a[4i .. 4i + 3]'s sums over that lane
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
    w[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // across the 128-bit lanes: w[i]'s four lanes summed, into 128-bit lane i of the result
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}
#endif

// silu(x) = x * sigmoid(x), through exp of -|x| (never positive, so exp_nonpositive applies).
inline float silu(float x) {
  const float e = exp_nonpositive(x < 0.f ? x : -x);
  return x * (x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
}

#if defined(__AVX2__) && defined(__FMA__)
// silu, eight at a time (the same steps).
inline __m256 silu8(__m256 x) {
  const __m256 e = exp8_nonpositive(_mm256_min_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), x)));
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.f), e, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
}
#endif

#if defined(__AVX512F__)
// 2^t for t <= 0: the work of exp16_nonpositive below (e^x = 2^t, t = x log2(e)), also for callers that fold log2(e)
// into a scaling of their own (the prefill attention's softmax). t = n + f with n = round(t), |f| <= 1/2; 2^f by a
// degree-5 polynomial (relative error ~2e-6: every caller rounds the result, or what it scales, to bf16) and 2^n by
// scalef, in place of exp8's exponent-bits arithmetic (t is clamped at -150, where 2^t is zero in float32). round(t)
// by adding and subtracting 1.5 * 2^23 (to nearest even, as VRNDSCALEPS rounds, for any |t| <= 2^22: the same n):
// two uops on either vector port, where VRNDSCALEPS takes two on port 0 alone of a Sapphire Rapids core. Ten vector
// ops for sixteen values where exp8's form took fifteen: the softmax of a prefill's attention and the SiLU of its
// activations are mostly this.
inline __m512 exp2_nonpositive(__m512 t_in) {
  const __m512 t = _mm512_max_ps(t_in, _mm512_set1_ps(-150.f));
  const __m512 magic = _mm512_set1_ps(12582912.f);  // 1.5 * 2^23: t + magic holds round(t) in its low bits
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp8_nonpositive and silu8's work in sixteen lanes: the SiLU of a prefill's [T, I] activations ran scalar on
// AVX-512 CPUs, ~1 ns an element, 14% of a 512-token prefill of the bundled model on one thread.
inline __m512 exp16_nonpositive(__m512 x) {
  return exp2_nonpositive(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
}

// x sigmoid(x) = x / (1 + e^-x), from e = e^-|x| (never overflows): x / (1 + e) for x >= 0, x e / (1 + e) below.
// The reciprocal by rcp14 and one Newton step (~23 bits) instead of a division, whose ~16-cycle throughput had set
// the SiLU's pace; the result is rounded to bf16 by its only caller (the fused decoder's bf16 activations).
inline __m512 silu16(__m512 x) {
  const __m512 e = exp16_nonpositive(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.f)), r);
  return _mm512_mul_ps(x, _mm512_mask_mul_ps(r, neg, r, e));
}
#endif

// The index of the first maximum of x[0, n) (torch.argmax's choice where x holds no NaN; NaNs are skipped, and
// 0 is returned where nothing is above -inf). The head's logits are 150K wide for a Qwen3: the scalar loop took
// ~1% of a 0.6B int4 decode step.
inline int64_t argmax_first(const float* x, int64_t n) {
  float best = -__builtin_inff();
  int64_t arg = 0, i = 0;
#if defined(__AVX512F__)
  if (n >= 16 && n <= INT32_MAX) {
    // per lane the first maximum of its positions (never a NaN: only a greater value replaces one), then the
    // smallest position among the lanes holding the overall maximum
    __m512 vmax = _mm512_set1_ps(best);
    __m512i vidx = _mm512_setzero_si512();
    __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16, cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16))) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    best = _mm512_reduce_max_ps(vmax);
    if (best > -__builtin_inff())
      arg = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ), vidx);
  }
#endif
  for (; i < n; ++i)
    if (x[i] > best) {
      best = x[i];
      arg = i;
    }
  return arg;
}
