// Attention for short query spans straight over the paged KV cache: decode (one query per sequence) and
// speculative verification (1 + K queries per sequence, the last 1 + K positions of its context). Keys and
// values are read once per (sequence, KV head), in place through the block table (no gather copies), and
// applied to every query of the span that sees them. Online softmax in float32.
//
// q [T, H, D] (sequence after sequence); k_cache, v_cache [num_blocks, block_size, KVH, D];
// block_tables [B, max_blocks] int64; seq_lens [B] int64 (context length including the new tokens);
// query_start_loc [B + 1] int64 (sequence b's queries are rows qsl[b] .. qsl[b + 1]) -> out [T, H, D].
// Query j of a span of n sits at position ctx - n + j and sees positions up to its own (causal);
// window > 0: only the last `window` positions up to its own (sliding-window attention).
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
static void spans_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const int64_t* qsl, double scale,
                       int64_t window, at::Tensor& out) {
  const int64_t B = seq_lens.size(0), H = q.size(1), D = q.size(2);
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
    std::vector<float> qf, acc, m, l, kf(D), vf(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t ctx = lens[b], row0 = qsl[b], nq = qsl[b + 1] - qsl[b];
      const int64_t R = nq * G;  // (query, head-in-group) rows of this item, r = j * G + g
      qf.assign(R * D, 0.f);
      acc.assign(R * D, 0.f);
      m.assign(R, -std::numeric_limits<float>::infinity());
      l.assign(R, 0.f);
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t g = 0; g < G; ++g) {
          const T* qrow = qp + ((row0 + j) * H + h * G + g) * D;
          float* dst = qf.data() + (j * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(qrow[d]) * static_cast<float>(scale);
        }
      const int64_t pos0 = ctx - nq;  // position of the span's first query
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 + 1 - window) : 0;
      for (int64_t pos = first; pos < ctx; ++pos) {
        const int64_t blk = tables[b * MB + pos / BS];
        to_float(kp + blk * blk_stride + (pos % BS) * tok_stride + h * D, kf.data(), D);
        to_float(vp + blk * blk_stride + (pos % BS) * tok_stride + h * D, vf.data(), D);
        const float* krow = kf.data();
        const float* vrow = vf.data();
        // Queries that see pos: j >= pos - pos0 (causal) and j < pos - pos0 + window (window).
        const int64_t j0 = std::max<int64_t>(0, pos - pos0);
        const int64_t j1 = window > 0 ? std::min<int64_t>(nq, pos - pos0 + window) : nq;
        for (int64_t r = j0 * G; r < j1 * G; ++r) {
          float dot = 0.f;
          const float* qr = qf.data() + r * D;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * krow[d];
          float* a = acc.data() + r * D;
          if (dot > m[r]) {  // rescale what was accumulated under the old maximum
            const float c = std::exp(m[r] - dot);
            l[r] *= c;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= c;
            m[r] = dot;
          }
          const float p = std::exp(dot - m[r]);
          l[r] += p;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
        }
      }
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = j * G + g;
          T* orow = op + ((row0 + j) * H + h * G + g) * D;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[r * D + d] * inv);
        }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong, "int64 metadata");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc has B + 1 entries");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  for (int64_t b = 0; b < sl.size(0); ++b)
    TORCH_CHECK(starts[b + 1] - starts[b] <= sl.data_ptr<int64_t>()[b], "a span longer than its context");
  TORCH_CHECK(starts[sl.size(0)] == q.size(0), "query_start_loc must end at the number of queries");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    spans_impl<scalar_t>(q, k_cache, v_cache, bt, sl, starts, scale, window, out);
  });
  return out;
}
