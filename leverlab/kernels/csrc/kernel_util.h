// Helpers the CPU kernels share: the bias as float32, and (AVX2 + FMA) a horizontal sum and max and the widening of
// 16 bfloat16 values in registers.
#pragma once
#include <torch/extension.h>

// The bias as a float32 pointer (nullptr without one); `holder` keeps the converted tensor alive.
inline const float* bias_f32(const c10::optional<at::Tensor>& bias, at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 16 bf16 values -> float32 without shuffles: a 32-bit lane's even element is the lane shifted left by 16, its
// odd element the lane with the low half masked off. So `even` holds elements 0, 2, .., 14 and `odd` 1, 3, .., 15;
// the other operand of a dot product is kept in the same split order.
inline void widen_bf16x16(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif
