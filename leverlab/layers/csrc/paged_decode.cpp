// Decode attention straight over the paged KV cache: one query token per sequence, keys and values read
// once, in place, through the block table (no gather copies). Online softmax in float32.
//
// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64 (context length including the new token) -> out [B, H, D].
// window > 0: only the last `window` positions are attended (sliding-window attention).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// Rows of the cache to float32. bfloat16 is the top half of a float32: a shift the compiler vectorizes.
template <typename T>
static inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

template <typename T>
static void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t tok_stride = KVH * D, blk_stride = BS * KVH * D;

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), s(G), kf(D), vf(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t ctx = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[d]) * static_cast<float>(scale);
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = first; pos < ctx; ++pos) {
        const int64_t blk = tables[b * MB + pos / BS];
        to_float(kp + blk * blk_stride + (pos % BS) * tok_stride + h * D, kf.data(), D);
        to_float(vp + blk * blk_stride + (pos % BS) * tok_stride + h * D, vf.data(), D);
        const float* krow = kf.data();
        const float* vrow = vf.data();
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          const float* qg = qf.data() + g * D;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[d];
          s[g] = dot;
        }
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc.data() + g * D;
          if (s[g] > m[g]) {  // rescale what was accumulated under the old maximum
            const float c = std::exp(m[g] - s[g]);
            l[g] *= c;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= c;
            m[g] = s[g];
          }
          const float p = std::exp(s[g] - m[g]);
          l[g] += p;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = op + (b * H + h * G + g) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 metadata");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(q, k_cache, v_cache, bt, sl, scale, window, out);
  });
  return out;
}
