// Attention for short query spans straight over the paged KV cache: decode (one query per sequence) and
// speculative verification (1 + K queries per sequence, the last 1 + K positions of its context).
//
// One op per layer does the whole step's attention: it writes the new tokens' K/V into their cache slots, then
// for each (sequence, KV head) reads that head's keys and values once, in place through the block table (no
// gather copies), for every query of the span and every head of the GQA group. Three passes over the
// context, each a loop the compiler vectorizes: scores q.k, a softmax over them (exp as a polynomial, so it
// vectorizes too), then the weighted sum of values. Float32 throughout.
//
// q [T, H, D] (sequence after sequence); k, v [T, KVH, D] (the new tokens, written to slot_mapping [T]);
// k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] int64; seq_lens [B] int64
// (context length including the new tokens); query_start_loc [B + 1] int64 (sequence b's queries are rows
// qsl[b] .. qsl[b + 1]) -> out [T, H, D]. Query j of a span of n sits at position ctx - n + j and sees
// positions up to its own (causal); window > 0: only the last `window` positions up to its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_util.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// A cache row as float32: float rows are used in place, others are converted into `buf`. bfloat16 is the top
// half of a float32: a shift the compiler vectorizes.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}
template <>
inline const float* as_float<c10::BFloat16>(const c10::BFloat16* src, float* buf, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
  return buf;
}


// One head's K (or V) rows sit KVH * D elements apart, too far for the hardware prefetcher to follow: fetched
// on demand, each position waited a memory latency (measured: 95 ns per position, 1.8 ms per layer for 16
// sequences of 150 tokens). So pass 1 requests rows kAhead positions early.
constexpr int64_t kAhead = 8;

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

template <typename T>
void write_new_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping) {
  const int64_t T_ = k.size(0), row = k.size(1) * k.size(2);  // one token's K (or V): KVH * D elements
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot ", sp[t], " is outside the KV cache");
    std::memcpy(kc + sp[t] * row, kp + t * row, row * sizeof(T));
    std::memcpy(vc + sp[t] * row, vp + t * row, row * sizeof(T));
  }
}

// Where one (sequence, KV head) item's rows are: the span's queries and the context they see.
struct Item {
  int64_t b, h, ctx, row0, nq, pos0, first;
};

// Softmax over each row's visible positions, in place: probs[r * L + i] is row r's score for position
// first + i; query j = r / G sees positions [lo, pos0 + j]. Writes 1 / sum into inv[r].
inline void softmax_rows(float* probs, float* inv, const Item& it, int64_t R, int64_t G, int64_t L, int64_t window) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t j = r / G;
    const int64_t lo = window > 0 ? std::max(it.first, it.pos0 + j + 1 - window) : it.first;
    const int64_t a = lo - it.first, e = it.pos0 + j + 1 - it.first;
    float* p = probs + r * L;
    float m = p[a];
    for (int64_t i = a + 1; i < e; ++i) m = std::max(m, p[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = a; i < e; ++i) {
      p[i] = exp_nonpositive(p[i] - m);
      sum += p[i];
    }
    inv[r] = 1.f / sum;
  }
}

// Rows r that see position pos: queries j in [j0, j1), r in [j0 * G, j1 * G).
inline std::pair<int64_t, int64_t> seeing(const Item& it, int64_t pos, int64_t G, int64_t window) {
  const int64_t j0 = std::max<int64_t>(0, pos - it.pos0);
  const int64_t j1 = window > 0 ? std::min<int64_t>(it.nq, pos - it.pos0 + window) : it.nq;
  return {j0 * G, j1 * G};
}

struct Buffers {
  std::vector<float> qf, acc, probs, inv, row;
  std::vector<int64_t> offs;  // row_offsets()
};

struct Layout {
  int64_t H, D, BS, KVH, G, MB, tok_stride, blk_stride;
  const int64_t* tables;
  int64_t window;
  float scale;
};

// Where each visible position's row of this item's KV head lies, as an element offset into either cache (K and V
// share the layout): one pass over the block table per item, so the passes over the context do no division.
inline void row_offsets(const Layout& lay, const Item& it, Buffers& buf) {
  buf.offs.resize(it.ctx - it.first);
  const int64_t* table = lay.tables + it.b * lay.MB;
  for (int64_t pos = it.first, i = 0; pos < it.ctx;) {
    const int64_t blk = pos / lay.BS, end = std::min(it.ctx, (blk + 1) * lay.BS);
    const int64_t base = table[blk] * lay.blk_stride + it.h * lay.D - blk * lay.BS * lay.tok_stride;
    for (; pos < end; ++pos, ++i) buf.offs[i] = base + pos * lay.tok_stride;
  }
}

// Any dtype and head size, in loops the compiler vectorizes.
template <typename T>
void item_generic(const T* qp, const T* kp, const T* vp, T* op, const Layout& lay, const Item& it, Buffers& buf) {
  const int64_t D = lay.D, G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  buf.qf.resize(R * D);
  buf.acc.assign(R * D, 0.f);
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  buf.row.resize(D);
  for (int64_t r = 0; r < R; ++r) {
    const T* qrow = qp + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) buf.qf[r * D + d] = static_cast<float>(qrow[d]) * lay.scale;
  }
  // Pass 1: scores.
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    if (pos + kAhead < it.ctx) {  // this head's rows are 2 KB or more apart: prefetch, for pass 3's V too
      prefetch_row(kp + buf.offs[pos + kAhead - it.first], D * sizeof(T));
      prefetch_row(vp + buf.offs[pos + kAhead - it.first], D * sizeof(T));
    }
    const float* kf = as_float(kp + buf.offs[pos - it.first], buf.row.data(), D);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const float* qr = buf.qf.data() + r * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kf[d];
      buf.probs[r * L + pos - it.first] = dot;
    }
  }
  // Pass 2: softmax.
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  // Pass 3: the probability-weighted sum of values.
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    const float* vf = as_float(vp + buf.offs[pos - it.first], buf.row.data(), D);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const float w = buf.probs[r * L + pos - it.first];
      float* a = buf.acc.data() + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * vf[d];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    T* orow = op + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(buf.acc[r * D + d] * buf.inv[r]);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 with a head size of D (a multiple of 32), the common case, in AVX-512: q.k straight from the bf16
// rows with dpbf16ps (products exact, sums in fp32), and each V row widened to fp32 once in registers and
// applied to every row that sees it. About 5x the generic loops' rate (which pay runtime trip counts and a
// widening copy per row).
template <int D>
void item_bf16(const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, uint16_t* op, const Layout& lay,
               const Item& it, Buffers& buf) {
  constexpr int C = D / 32;  // 32-element chunks of a row
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  buf.acc.assign(R * D, 0.f);
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  auto qrow = [&](int64_t r) { return qp + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D; };
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    if (pos + kAhead < it.ctx) {
      prefetch_row(kp + buf.offs[pos + kAhead - it.first], D * 2);
      prefetch_row(vp + buf.offs[pos + kAhead - it.first], D * 2);
    }
    const uint16_t* k = kp + buf.offs[pos - it.first];
    __m512bh kv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* q = qrow(r);
      __m512 s = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(q + 32 * c), kv[c]);
      buf.probs[r * L + pos - it.first] = _mm512_reduce_add_ps(s) * lay.scale;
    }
  }
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    const uint16_t* v = vp + buf.offs[pos - it.first];
    __m512 vf[D / 16];
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c)  // bf16 -> fp32: widen to 32 bits, shift into the top half
      vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c))), 16));
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 w = _mm512_set1_ps(buf.probs[r * L + pos - it.first]);
      float* a = buf.acc.data() + r * D;
#pragma GCC unroll 16
      for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, vf[c], _mm512_loadu_ps(a + 16 * c)));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* orow = op + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = c10::BFloat16(buf.acc[r * D + d] * buf.inv[r]).x;
  }
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#define LEVERLAB_ATTN_AVX2 1
// The same for CPUs with AVX2 + FMA but no AVX-512 BF16 (Zen 2/3, Haswell..Skylake client). A 16-element bf16
// chunk widens in registers with no shuffles: a 32-bit lane's even element is the lane shifted left by 16, its odd
// element the lane with the low half masked off (as skinny_linear.cpp does). So q is kept as floats split into
// even and odd halves per chunk, the value accumulators are split the same way, and the output is put back in
// order at the end. About 5x the generic loops on a Zen 3 (decode at 1,500 tokens of context).
template <int D>
void item_bf16(const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, uint16_t* op, const Layout& lay,
               const Item& it, Buffers& buf) {
  constexpr int C = D / 16;  // 16-element chunks of a row
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  buf.qf.resize(R * D);  // per row and chunk: the 8 even elements, then the 8 odd ones
  buf.acc.assign(R * D, 0.f);  // the same order
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* q = qp + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    float* qf = buf.qf.data() + r * D;
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 8; ++j) {
        qf[16 * c + j] = c10::BFloat16(q[16 * c + 2 * j], c10::BFloat16::from_bits()) * lay.scale;
        qf[16 * c + 8 + j] = c10::BFloat16(q[16 * c + 2 * j + 1], c10::BFloat16::from_bits()) * lay.scale;
      }
  }
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    if (pos + kAhead < it.ctx) {
      prefetch_row(kp + buf.offs[pos + kAhead - it.first], D * 2);
      prefetch_row(vp + buf.offs[pos + kAhead - it.first], D * 2);
    }
    const uint16_t* k = kp + buf.offs[pos - it.first];
    __m256 ke[C], ko[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) widen_bf16x16(k + 16 * c, ke[c], ko[c]);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const float* qf = buf.qf.data() + r * D;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        s0 = _mm256_fmadd_ps(ke[c], _mm256_loadu_ps(qf + 16 * c), s0);
        s1 = _mm256_fmadd_ps(ko[c], _mm256_loadu_ps(qf + 16 * c + 8), s1);
      }
      buf.probs[r * L + pos - it.first] = hsum8(_mm256_add_ps(s0, s1));
    }
  }
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    const uint16_t* v = vp + buf.offs[pos - it.first];
    __m256 ve[C], vo[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) widen_bf16x16(v + 16 * c, ve[c], vo[c]);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const __m256 p = _mm256_set1_ps(buf.probs[r * L + pos - it.first]);
      float* a = buf.acc.data() + r * D;
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        _mm256_storeu_ps(a + 16 * c, _mm256_fmadd_ps(p, ve[c], _mm256_loadu_ps(a + 16 * c)));
        _mm256_storeu_ps(a + 16 * c + 8, _mm256_fmadd_ps(p, vo[c], _mm256_loadu_ps(a + 16 * c + 8)));
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* orow = op + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    const float* a = buf.acc.data() + r * D;
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 8; ++j) {
        orow[16 * c + 2 * j] = c10::BFloat16(a[16 * c + j] * buf.inv[r]).x;
        orow[16 * c + 2 * j + 1] = c10::BFloat16(a[16 * c + 8 + j] * buf.inv[r]).x;
      }
  }
}
#endif

template <typename T>
void spans_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const int64_t* qsl, double scale,
                int64_t window, at::Tensor& out) {
  const int64_t B = seq_lens.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const Layout lay{H, D, BS, KVH, H / KVH, block_tables.size(1), KVH * D, BS * KVH * D,
                   block_tables.data_ptr<int64_t>(), window, static_cast<float>(scale)};
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    Buffers buf;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, ctx = lens[b], nq = qsl[b + 1] - qsl[b];
      const int64_t pos0 = ctx - nq;  // position of the span's first query
      const Item it{b, i % KVH, ctx, qsl[b], nq, pos0, window > 0 ? std::max<int64_t>(0, pos0 + 1 - window) : 0};
      row_offsets(lay, it, buf);
#if defined(__AVX512BF16__) || defined(LEVERLAB_ATTN_AVX2)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        auto u = [](auto* p) { return reinterpret_cast<uint16_t*>(const_cast<T*>(p)); };
        if (D == 64) { item_bf16<64>(u(qp), u(kp), u(vp), u(op), lay, it, buf); continue; }
        if (D == 128) { item_bf16<128>(u(qp), u(kp), u(vp), u(op), lay, it, buf); continue; }
        if (D == 256) { item_bf16<256>(u(qp), u(kp), u(vp), u(op), lay, it, buf); continue; }
      }
#endif
      item_generic(qp, kp, vp, op, lay, it, buf);
    }
  });
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                        int64_t window) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "int64 metadata");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == k_cache.scalar_type(), "q, k, v and the cache must share a dtype");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc has B + 1 entries");
  TORCH_CHECK(slot_mapping.numel() == k.size(0) && k.sizes() == v.sizes() && k.size(0) == q.size(0),
              "one slot and one K/V row per query");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), slots = slot_mapping.contiguous();
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  for (int64_t b = 0; b < sl.size(0); ++b)
    TORCH_CHECK(starts[b + 1] - starts[b] <= sl.data_ptr<int64_t>()[b], "a span longer than its context");
  TORCH_CHECK(starts[sl.size(0)] == q.size(0), "query_start_loc must end at the number of queries");
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    write_new_kv<scalar_t>(kc, vc, k_cache, v_cache, slots);
    spans_impl<scalar_t>(qc, k_cache, v_cache, bt, sl, starts, scale, window, out);
  });
  return out;
}
