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
// k_cache, v_cache [num_blocks, block_size, KVH, D] (either memory order: CacheStrides); block_tables
// [B, max_blocks] int64; seq_lens [B] int64 (context length including the new tokens); query_start_loc [B + 1]
// int64 (sequence b's queries are rows qsl[b] .. qsl[b + 1]) -> out [T, H, D]. Query j of a span of n sits at
// position ctx - n + j and sees positions up to its own (causal); window > 0: only the last `window` positions up
// to its own.
//
// An int8 KV cache (--kv-cache-dtype int8, quant/kv_cache.py): the caches are int8 with float32 scales
// k_scale, v_scale [num_blocks, block_size, KVH], one per (slot, KV head). The new tokens are quantized here
// exactly as kv_cache.quantize does (so prefill's Python writes and decode's writes agree bit for bit), and
// the passes dequantize each row in registers: half the bytes of a bf16 cache read, no gather copy.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_util.h"
#include "vec_math.h"

bool amx_bf16_enabled();  // amx_bf16.cpp: built with AMX-BF16, granted by the OS, not switched off

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// Fresh bf16 prompts on AMX tiles (amx_attention.cpp).
bool amx_attention_takes(int64_t D);
void amx_fresh_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out, double scale);

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

// In a slot-major cache one head's K (or V) rows sit KVH * D elements apart, too far for the hardware prefetcher
// to follow: fetched on demand, each position waited a memory latency (measured: 95 ns per position, 1.8 ms per
// layer for 16 sequences of 150 tokens). So pass 1 requests rows kAhead positions early. The engine's head-major
// blocks put a head's rows of a block together, but blocks are scattered, so the requests still pay.
constexpr int64_t kAhead = 8;
// The int8 cache's integer path (item_q8_vnni) spends ~20 ns a position where the float loops spent ~50, so 8
// positions ahead no longer covered a memory latency: 32 read 1.2x faster than 8 over the bundled model's 16 x 1,000
// cold cache, and 16 or 32 the same over the 0.6B shape's (1.5x; 64 slower there). A Zen 4, one thread.
constexpr int64_t kAheadQ8 = 32;
// The bf16 cache's AVX-512 path (item_bf16): 16 positions ahead read 1.03-1.05x faster than 8 in each of four
// cold cases (the bundled model's heads at 16 x 1,000 tokens; the 0.6B shape's at 16 x 1,000, and one sequence of
// 160 and of 1,000 over 28 layers, two threads); 32 gained 0-8%, once nothing. In one process.
constexpr int64_t kAheadBf16 = 16;

// The scores pass requests its rows into L2 (PREFETCHT1), not L1 (T0): a standalone harness over the 0.6B shape's
// 28 layers of bf16 cache, one sequence, two threads, 13 MB of other reads between layers as a step's weights
// (a Zen 4): T0 8 positions ahead read the cold cache at 11-15 GB/s, T1 or T2 at 16-20, as fast as a
// plain read of the same rows (14-20); the distance (8 or 16 positions, 1, 2 or 4 blocks) mattered less. The V
// pass, which meets rows this pass already brought into L2, keeps T0 (prefetch_row_l1) to bring them nearer.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}
inline void prefetch_row_l1(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Where the caches' elements are (in elements): block, slot-in-block and head strides; a head's D elements are
// contiguous. Both layouts of one logical shape [num_blocks, block_size, KVH, D] are read through these: the
// engine allocates blocks head-major (quant/kv_cache.py allocate: each head's block_size rows contiguous, read front
// to back by the kernels below), a plain contiguous tensor is slot-major (one token's KVH rows together).
struct CacheStrides {
  int64_t blk, tok, head, BS;
  explicit CacheStrides(const at::Tensor& c)
      : blk(c.stride(0)), tok(c.stride(1)), head(c.stride(2)), BS(c.size(1)) {}
  // The element offset of head h's row for cache slot `slot` (block slot / BS, row slot % BS).
  int64_t row(int64_t slot, int64_t h) const { return slot / BS * blk + slot % BS * tok + h * head; }
};

template <typename T>
void write_new_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping) {
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const CacheStrides cs(k_cache);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot ", sp[t], " is outside the KV cache");
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = cs.row(sp[t], h);
      std::memcpy(kc + dst, kp + t * k.stride(0) + h * D, D * sizeof(T));
      std::memcpy(vc + dst, vp + t * v.stride(0) + h * D, D * sizeof(T));
    }
  }
}

// The new tokens' K/V into an int8 cache, per (token, KV head): scale = max|x| / 127 (at least 1e-8), each
// element round-half-even(x / scale) clamped to +-127, in float32: kv_cache.quantize's arithmetic, op for op.
template <typename T>
void write_new_kv_q8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     float* k_scale, float* v_scale, const at::Tensor& slot_mapping) {
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const CacheStrides cs(k_cache);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  auto one = [&](const T* x, int8_t* dst, float* sc) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
    const float s = std::max(amax / 127.0f, 1e-8f);
    for (int64_t d = 0; d < D; ++d)
      dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[d]) / s))));
    *sc = s;
  };
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  int8_t* kc = static_cast<int8_t*>(k_cache.data_ptr());
  int8_t* vc = static_cast<int8_t*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "slot ", sp[t], " is outside the KV cache");
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = cs.row(sp[t], h);  // scales: the row's offset / D
      one(kp + t * k.stride(0) + h * D, kc + dst, k_scale + dst / D);
      one(vp + t * v.stride(0) + h * D, vc + dst, v_scale + dst / D);
    }
  }
}

// Where one (sequence, KV head) item's rows are: the span's queries and the context they see.
struct Item {
  int64_t b, h, ctx, row0, nq, pos0, first;
};

// p[0 .. n) -> exp(p[i] - max) in place; returns 1 / their sum. With AVX2 eight at a time: gcc left the
// `omp simd` form of this loop scalar (the exp's float -> int -> float steps), and in the tiled prefill path it
// was 40% of the attention's time.
inline float softmax_span(float* p, int64_t n) {
  float m = p[0];
  int64_t i = 1;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 9) {  // the max eight lanes at a time too: as a scalar chain it took a third of this function
    __m256 mv = _mm256_loadu_ps(p);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + i));
    m = hmax8(mv);
  }
#endif
  for (; i < n; ++i) m = std::max(m, p[i]);
  float sum = 0.f;
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) {
    p[i] = exp_nonpositive(p[i] - m);
    sum += p[i];
  }
  return 1.f / sum;
}

// The positions [lo, e) row r (query j = r / G) sees: up to its own, pos0 + j, and within the window.
inline std::pair<int64_t, int64_t> visible_positions(const Item& it, int64_t r, int64_t G, int64_t window) {
  const int64_t j = r / G;
  return {window > 0 ? std::max(it.first, it.pos0 + j + 1 - window) : it.first, it.pos0 + j + 1};
}

// Softmax over each row's visible positions, in place: probs[r * L + i] is row r's score for position
// first + i. Writes 1 / sum into inv[r].
inline void softmax_rows(float* probs, float* inv, const Item& it, int64_t R, int64_t G, int64_t L, int64_t window) {
  for (int64_t r = 0; r < R; ++r) {
    const auto [lo, e] = visible_positions(it, r, G, window);
    inv[r] = softmax_span(probs + r * L + lo - it.first, e - lo);
  }
}

// Rows r that see position pos: queries j in [j0, j1), r in [j0 * G, j1 * G).
inline std::pair<int64_t, int64_t> seeing(const Item& it, int64_t pos, int64_t G, int64_t window) {
  const int64_t j0 = std::max<int64_t>(0, pos - it.pos0);
  const int64_t j1 = window > 0 ? std::min<int64_t>(it.nq, pos - it.pos0 + window) : it.nq;
  return {j0 * G, j1 * G};
}

struct Buffers {
  std::vector<float> qf, acc, probs, inv, row, part;
  std::vector<float> qs, ws, ksf, vsf;  // integer int8 paths: query scales, per-group weight scales, K/V scales
  std::vector<int16_t> q16, w16;
  std::vector<int64_t> offs;  // row_offsets()
};

struct Layout {
  int64_t H, D, BS, KVH, G, MB, tok_stride, head_stride, blk_stride;  // the strides: CacheStrides
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
    const int64_t base = table[blk] * lay.blk_stride + it.h * lay.head_stride - blk * lay.BS * lay.tok_stride;
    for (; pos < end; ++pos, ++i) buf.offs[i] = base + pos * lay.tok_stride;
  }
}

// The item's R query rows as float32 times the softmax scale, into buf.qf [R, D] (the loops that read q as floats).
template <typename T>
inline void scaled_queries(const T* qp, const Layout& lay, const Item& it, int64_t R, Buffers& buf) {
  const int64_t D = lay.D, G = lay.G;
  buf.qf.resize(R * D);
  for (int64_t r = 0; r < R; ++r) {
    const T* q = qp + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) buf.qf[r * D + d] = static_cast<float>(q[d]) * lay.scale;
  }
}

// The item's R query rows as int16 for the integer int8-cache paths (item_q8_vnni, item_q8_i16): each row at its
// own scale max|q| / 32767 (a relative step of 2^-15, where bfloat16 itself keeps 2^-8), into buf.q16 [R, D];
// buf.qs[r] is that scale times the softmax scale.
template <typename T>
inline void queries_i16(const T* qp, const Layout& lay, const Item& it, int64_t R, Buffers& buf) {
  const int64_t D = lay.D, G = lay.G;
  buf.q16.resize(R * D);
  buf.qs.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    const T* q = qp + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(q[d])));
    const float s = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / s;
    for (int64_t d = 0; d < D; ++d)
      buf.q16[r * D + d] = static_cast<int16_t>(std::nearbyint(static_cast<float>(q[d]) * inv));
    buf.qs[r] = s * lay.scale;
  }
}

// A cache row as float32, dequantized with its scale when the cache is int8.
template <typename C>
inline const float* row_as_float(const C* src, const float* scales, int64_t off, int64_t D, float* buf) {
  if constexpr (std::is_same_v<C, int8_t>) {
    const float s = scales[off / D];  // one scale per (slot, head): the row's element offset / D
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) buf[i] = static_cast<float>(src[off + i]) * s;
    return buf;
  } else {
    return as_float(src + off, buf, D);
  }
}

// Any dtype and head size, in loops the compiler vectorizes. T: q and out; C: the cache (T, or int8 with scales).
template <typename T, typename C>
void item_generic(const T* qp, const C* kp, const C* vp, const float* ksc, const float* vsc, T* op,
                  const Layout& lay, const Item& it, Buffers& buf) {
  const int64_t D = lay.D, G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  scaled_queries(qp, lay, it, R, buf);
  buf.acc.assign(R * D, 0.f);
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  buf.row.resize(D);
  // Pass 1: scores.
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    if (pos + kAhead < it.ctx) {  // this head's rows are 2 KB or more apart: prefetch, for pass 3's V too
      prefetch_row(kp + buf.offs[pos + kAhead - it.first], D * sizeof(C));
      prefetch_row(vp + buf.offs[pos + kAhead - it.first], D * sizeof(C));
    }
    const float* kf = row_as_float(kp, ksc, buf.offs[pos - it.first], D, buf.row.data());
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
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {  // V rows from L2 (pass 1 fetched them), into L1 ahead
    if (pos + kAhead < it.ctx) prefetch_row_l1(vp + buf.offs[pos + kAhead - it.first], D * sizeof(C));
    const float* vf = row_as_float(vp, vsc, buf.offs[pos - it.first], D, buf.row.data());
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
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  auto qrow = [&](int64_t r) { return qp + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D; };
  // Scores 16 positions at a time, every row for each block (a row's scores past what it sees are computed and
  // never read: softmax_rows and the V pass below take only the visible ones), the 16 dot products of a row
  // reduced together (hsum16): one horizontal sum per score had cost three times its four dpbf16ps.
  for (int64_t p0 = it.first; p0 < it.ctx; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, it.ctx - p0));
    for (int i = 0; i < n; ++i)
      if (p0 + i + kAheadBf16 < it.ctx) {
        prefetch_row(kp + buf.offs[p0 + i + kAheadBf16 - it.first], D * 2);
        prefetch_row(vp + buf.offs[p0 + i + kAheadBf16 - it.first], D * 2);
      }
    // A short last block repeats its last row: every position's dot product is computed without a branch, so the
    // 16 accumulators stay in registers (with `if (i >= n) continue` gcc kept them in memory, and each position's
    // four dpbf16ps waited on a store and a reload); the extra scores are never stored.
    const uint16_t* krow[16];
    for (int i = 0; i < 16; ++i) krow[i] = kp + buf.offs[p0 + std::min(i, n - 1) - it.first];
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* q = qrow(r);
      __m512bh qv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
      __m512 s[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        s[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c)
          s[i] = _mm512_dpbf16_ps(s[i], qv[c], (__m512bh)_mm512_loadu_si512(krow[i] + 32 * c));
      }
      const __m512 v = _mm512_mul_ps(hsum16(s), _mm512_set1_ps(lay.scale));
      _mm512_mask_storeu_ps(buf.probs.data() + r * L + p0 - it.first, static_cast<__mmask16>((1u << n) - 1), v);
    }
  }
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  // P V, two rows at a time with their accumulators in registers (up to D = 128: 16 of them and the widened V row's
  // 8), each V row widened once per pair. (Accumulated in memory, a load, an FMA and a store per 16 elements, this
  // pass had cost three times the scores.) Positions in increasing order and the same FMAs as row by row, so the
  // sums are the same bit for bit; a position one row of the pair does not see is skipped for that row.
  constexpr int DV = D / 16;
  constexpr int64_t kPair = D <= 128 ? 2 : 1;
  for (int64_t r = 0; r < R; r += kPair) {
    const bool two = kPair == 2 && r + 1 < R;
    const auto [lo0, e0] = visible_positions(it, r, G, lay.window);
    const auto [lo1, e1] = two ? visible_positions(it, r + 1, G, lay.window) : std::pair<int64_t, int64_t>{0, 0};
    const int64_t plo = two ? std::min(lo0, lo1) : lo0, phi = two ? std::max(e0, e1) : e0;
    __m512 a0[DV], a1[DV];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) a0[c] = a1[c] = _mm512_setzero_ps();
    const float* p0 = buf.probs.data() + r * L;  // row r's probabilities, position first at index 0
    const float* p1 = p0 + L;
    for (int64_t pos = plo; pos < phi; ++pos) {
      // the scores' pass fetched V into the caches; ahead of this pass, into L1 again (perf: the V loads were this
      // pass's hottest instructions)
      if (pos + kAhead < phi) prefetch_row_l1(vp + buf.offs[pos + kAhead - it.first], D * 2);
      const uint16_t* v = vp + buf.offs[pos - it.first];
      // bf16 -> fp32 without shuffles, 32 elements a load: a 32-bit lane's even element is the lane shifted left
      // by 16, its odd element the lane with its low half masked off. So vf[2c] holds elements 32c + 0, 2, .., 30
      // and vf[2c + 1] elements 32c + 1, 3, .., 31, the accumulators the same, put back in order at the end (each
      // lane sums the same products in the same order as before: the same bits). Widening 16 at a time
      // (vpmovzxwd and a shift) had taken two operations per 16 elements where this takes one.
      __m512 vf[DV];
#pragma GCC unroll 8
      for (int c = 0; c < DV / 2; ++c) {
        const __m512i w = _mm512_loadu_si512(v + 32 * c);
        vf[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        vf[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      }
      if (pos >= lo0 && pos < e0) {
        const __m512 w = _mm512_set1_ps(p0[pos - it.first]);
#pragma GCC unroll 16
        for (int c = 0; c < DV; ++c) a0[c] = _mm512_fmadd_ps(w, vf[c], a0[c]);
      }
      if (two && pos >= lo1 && pos < e1) {
        const __m512 w = _mm512_set1_ps(p1[pos - it.first]);
#pragma GCC unroll 16
        for (int c = 0; c < DV; ++c) a1[c] = _mm512_fmadd_ps(w, vf[c], a1[c]);
      }
    }
    for (int i = 0; i < (two ? 2 : 1); ++i) {
      alignas(64) float split[D], out[D];
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) _mm512_store_ps(split + 16 * c, i ? a1[c] : a0[c]);
      for (int c = 0; c < DV / 2; ++c)
        for (int j = 0; j < 16; ++j)
          out[32 * c + 2 * j] = split[32 * c + j], out[32 * c + 2 * j + 1] = split[32 * c + 16 + j];
      const int64_t rr = r + i;
      uint16_t* orow = op + ((it.row0 + rr / G) * lay.H + it.h * G + rr % G) * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = c10::BFloat16(out[d] * buf.inv[rr]).x;
    }
  }
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#define LEVERLAB_ATTN_AVX2 1
// The same for CPUs with AVX2 + FMA but no AVX-512 BF16 (Zen 1-3, Haswell..Skylake client). A 16-element bf16
// chunk widens in registers with no shuffles: a 32-bit lane's even element is the lane shifted left by 16, its odd
// element the lane with the low half masked off (as skinny_linear.cpp does). So q is kept as floats split into
// even and odd halves per chunk, the value accumulators are split the same way, and the output is put back in
// order at the end.
// Both passes keep their accumulators in registers (16 ymm registers in all), so that their loop bodies are loads,
// widening and FMAs only:
//  - scores: NP positions for NR rows at a time (NR * NP = 8 accumulators; NR = 2 for a GQA group of 2, the
//    common decode), each K chunk widened once for the NR rows, and the NP dot products of a row reduced together
//    by one horizontal-add tree (one hsum per score had been about as many ops as its FMAs);
//  - values: 32 elements of the output for NR rows at a time (8 accumulators), over a tile of kVTile positions,
//    then the next 32 elements over the same tile, whose V rows are still in L1; the accumulators go to memory
//    once per tile and 32 elements. (Accumulated in memory per position, a load, an FMA and a store per 8 elements,
//    this pass was bound by its stores: a Zen 1 stores one 128-bit half a cycle.)
// A position a row does not see (a speculative span's later positions, a window) has its score computed and
// never read, and its probability zeroed after the softmax, so that the value pass runs every row over the same
// positions: adding 0 * v leaves a sum unchanged.
// Measured on a Zen 1, the 0.6B shape's heads (8 KV heads, GQA 2, D = 128), 28 layers, one sequence: see
// docs/engine.md (CPU kernels, AVX2 + FMA).
constexpr int64_t kVTile = 32;
// The scores pass requests K rows this many positions ahead: a position costs its two rows ~30 cycles here, so
// the 8 of kAhead gave a miss ~100 ns of warning, about its latency (16, with the values pass's requests above:
// see there).
constexpr int64_t kAheadK = 16;

// Row r0's (and, NR = 2, row r0 + 1's) scores for the NP positions whose K rows are krow[0 .. NP): q rows qf0,
// qf1 in the split order above, into s0, s1 (NP floats each).
template <int C, int NR, int NP>
inline void scores_block(const uint16_t* const* krow, const float* qf0, const float* qf1, float* s0, float* s1) {
  static_assert(NR * NP == 8, "eight accumulators");
  __m256 a[NR][NP];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) a[j][i] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const __m256 qe0 = _mm256_loadu_ps(qf0 + 16 * c), qo0 = _mm256_loadu_ps(qf0 + 16 * c + 8);
    const __m256 qe1 = NR == 2 ? _mm256_loadu_ps(qf1 + 16 * c) : qe0;
    const __m256 qo1 = NR == 2 ? _mm256_loadu_ps(qf1 + 16 * c + 8) : qo0;
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) {
      __m256 ke, ko;
      widen_bf16x16(krow[i] + 16 * c, ke, ko);
      a[0][i] = _mm256_fmadd_ps(ko, qo0, _mm256_fmadd_ps(ke, qe0, a[0][i]));
      if constexpr (NR == 2) a[1][i] = _mm256_fmadd_ps(ko, qo1, _mm256_fmadd_ps(ke, qe1, a[1][i]));
    }
  }
  // Four accumulators -> their four sums: two levels of vhaddps leave, in each 128-bit half, accumulator i's
  // partial sum in lane i; the halves then add.
  auto four = [](const __m256* v) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    float* s = j ? s1 : s0;
#pragma GCC unroll 2
    for (int i = 0; i < NP; i += 4) _mm_storeu_ps(s + i, four(a[j] + i));
  }
}

// Rows r0 (and r0 + 1) of P V over positions [p0, p1) of the item, output elements [32 d, 32 d + 32) in the split
// order, accumulated into acc0 (acc1) at that offset: probabilities pr0, pr1 indexed by position - first. Rows of
// positions up to fetch_end are requested into L1 a tile early, spread over the tile's passes: pass d (output
// elements 32 d ..) requests line d of the next tile's rows, the line that pass will read there (a row of D bf16
// is D / 32 lines, one per pass); item_bf16 requests the first tile's rows before the first pass.
// The scores pass requests only K: V rows it had requested too were evicted again before this pass at long
// contexts (a head's K and V of 1,000 positions are 512 KB, this machine's whole L2 per core) and took bandwidth
// from K's. Before, the first pass over a tile requested whole rows 16 positions ahead, measured 1.12-1.16x
// over none on the Zen 1 machine type; but a first pass runs a position in ~8 cycles, so 16 positions were ~50 ns
// of warning for a ~100 ns miss, and the four lines of each row came due at once, while the tile's other three
// passes (which read L1) requested nothing. Measured now on the same machine type (28 layers of the 0.6B shape's
// heads, head-major blocks in huge pages, scattered, two threads, 8 MB of other reads before each layer, old and
// new alternating in one process, paired medians; with the scores pass's distance below): one sequence of 1,000
// tokens 1.12x, of 160 tokens 1.05x, 16 sequences of 1,000 1.16x, of 160 1.13x.
template <int D, int NR>
inline void values_block(const uint16_t* vp, const int64_t* offs, const float* pr0, const float* pr1, int64_t p0,
                         int64_t p1, int d, float* acc0, float* acc1, int64_t fetch_end) {
  __m256 a[NR][4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    a[0][k] = _mm256_loadu_ps(acc0 + 32 * d + 8 * k);
    if constexpr (NR == 2) a[1][k] = _mm256_loadu_ps(acc1 + 32 * d + 8 * k);
  }
  for (int64_t i = p0; i < p1; ++i) {
    if (i + kVTile < fetch_end) __builtin_prefetch(vp + offs[i + kVTile] + 32 * d, 0, 3);  // line d, a tile on
    const uint16_t* v = vp + offs[i] + 32 * d;
    __m256 ve0, vo0, ve1, vo1;
    widen_bf16x16(v, ve0, vo0);
    widen_bf16x16(v + 16, ve1, vo1);
    const __m256 w0 = _mm256_broadcast_ss(pr0 + i);
    a[0][0] = _mm256_fmadd_ps(w0, ve0, a[0][0]);
    a[0][1] = _mm256_fmadd_ps(w0, vo0, a[0][1]);
    a[0][2] = _mm256_fmadd_ps(w0, ve1, a[0][2]);
    a[0][3] = _mm256_fmadd_ps(w0, vo1, a[0][3]);
    if constexpr (NR == 2) {
      const __m256 w1 = _mm256_broadcast_ss(pr1 + i);
      a[1][0] = _mm256_fmadd_ps(w1, ve0, a[1][0]);
      a[1][1] = _mm256_fmadd_ps(w1, vo0, a[1][1]);
      a[1][2] = _mm256_fmadd_ps(w1, ve1, a[1][2]);
      a[1][3] = _mm256_fmadd_ps(w1, vo1, a[1][3]);
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(acc0 + 32 * d + 8 * k, a[0][k]);
    if constexpr (NR == 2) _mm256_storeu_ps(acc1 + 32 * d + 8 * k, a[1][k]);
  }
}

template <int D>
void item_bf16(const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, uint16_t* op, const Layout& lay,
               const Item& it, Buffers& buf) {
  static_assert(D % 32 == 0, "the value pass takes 32 elements at a time");
  constexpr int C = D / 16;  // 16-element chunks of a row
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  buf.qf.resize(R * D);  // per row and chunk: the 8 even elements, then the 8 odd ones
  buf.acc.assign(R * D, 0.f);  // the same order
  const int64_t Lp = (L + 7) / 8 * 8;  // probs' row stride: a last block of scores stores up to 7 past the row
  buf.probs.resize(R * Lp);
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
  const int64_t* offs = buf.offs.data();  // position first + i's row at offs[i]
  float* probs = buf.probs.data();
  // Scores: rows in pairs (4 positions a step), a last odd row alone (8 positions a step). A short last block
  // repeats its last position; its extra scores land in the row's padding and are never read.
  auto scores = [&]<int NR, int NP>(int64_t r) {
    for (int64_t i0 = 0; i0 < L; i0 += NP) {
      const uint16_t* krow[NP];
#pragma GCC unroll 8
      for (int i = 0; i < NP; ++i) {
        const int64_t j = std::min<int64_t>(i0 + i, L - 1);
        krow[i] = kp + offs[j];
        if (r == 0 && i0 + i + kAheadK < L) prefetch_row(kp + offs[i0 + i + kAheadK], D * 2);  // K into L2
      }
      const float* q0 = buf.qf.data() + r * D;
      scores_block<C, NR, NP>(krow, q0, q0 + D, probs + r * Lp + i0, probs + (r + 1) * Lp + i0);
    }
  };
  for (int64_t i = 0; i < std::min(L, kAheadK); ++i) prefetch_row(kp + offs[i], D * 2);  // up to the first request
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) scores.template operator()<2, 4>(r);
  if (r < R) scores.template operator()<1, 8>(r);
  softmax_rows(probs, buf.inv.data(), it, R, G, Lp, lay.window);
  for (int64_t rr = 0; rr < R; ++rr) {  // what a row does not see weighs 0 in the value pass
    const auto [lo, e] = visible_positions(it, rr, G, lay.window);
    std::fill(probs + rr * Lp, probs + rr * Lp + (lo - it.first), 0.f);
    std::fill(probs + rr * Lp + (e - it.first), probs + rr * Lp + L, 0.f);
  }
  // Values: tile by tile, 32 output elements at a time.
  for (int64_t i = 0; i < std::min(L, kVTile); ++i) prefetch_row_l1(vp + offs[i], 2 * D);  // the first tile
  for (int64_t p0 = 0; p0 < L; p0 += kVTile) {
    const int64_t p1 = std::min(L, p0 + kVTile);
    for (r = 0; r + 2 <= R; r += 2)
      for (int d = 0; d < D / 32; ++d)
        values_block<D, 2>(vp, offs, probs + r * Lp, probs + (r + 1) * Lp, p0, p1, d, buf.acc.data() + r * D,
                        buf.acc.data() + (r + 1) * D, r == 0 ? L : 0);
    if (r < R)
      for (int d = 0; d < D / 32; ++d)
        values_block<D, 1>(vp, offs, probs + r * Lp, nullptr, p0, p1, d, buf.acc.data() + r * D, nullptr,
                        r == 0 ? L : 0);
  }
  for (r = 0; r < R; ++r) {
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

#if defined(__AVX2__) && defined(__FMA__)
#define LEVERLAB_ATTN_Q8 1
// An int8 cache with a head size of D (a multiple of 8), any activation dtype, in AVX2 (AVX-512 machines take
// item_q8_512 below). 8 int8 elements widen to float32 in two instructions (sign-extend, convert) and take the row's
// scale in a third, so a row is dequantized in registers once and applied to every query row that sees it:
// the same association as the gather path (q . (k * s), p * (v * s)). Everything stays in natural order.
template <int D, typename T>
void item_q8(const T* qp, const int8_t* kp, const int8_t* vp, const float* ksc, const float* vsc, T* op,
             const Layout& lay, const Item& it, Buffers& buf) {
  constexpr int C = D / 8;  // 8-element chunks of a row
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  scaled_queries(qp, lay, it, R, buf);
  buf.acc.assign(R * D, 0.f);
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  auto widen = [](const int8_t* p, float s, __m256* out) {
    const __m256 sv = _mm256_set1_ps(s);
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c)
      out[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c)))), sv);
  };
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    if (pos + kAhead < it.ctx) {
      prefetch_row(kp + buf.offs[pos + kAhead - it.first], D);
      prefetch_row(vp + buf.offs[pos + kAhead - it.first], D);
    }
    const int64_t off = buf.offs[pos - it.first];
    __m256 kf[C];
    widen(kp + off, ksc[off / D], kf);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const float* qf = buf.qf.data() + r * D;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
#pragma GCC unroll 32
      for (int c = 0; c + 1 < C; c += 2) {
        s0 = _mm256_fmadd_ps(kf[c], _mm256_loadu_ps(qf + 8 * c), s0);
        s1 = _mm256_fmadd_ps(kf[c + 1], _mm256_loadu_ps(qf + 8 * c + 8), s1);
      }
      if constexpr (C % 2) s0 = _mm256_fmadd_ps(kf[C - 1], _mm256_loadu_ps(qf + 8 * (C - 1)), s0);
      buf.probs[r * L + pos - it.first] = hsum8(_mm256_add_ps(s0, s1));
    }
  }
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  for (int64_t pos = it.first; pos < it.ctx; ++pos) {
    if (pos + kAhead < it.ctx) prefetch_row_l1(vp + buf.offs[pos + kAhead - it.first], D);
    const int64_t off = buf.offs[pos - it.first];
    __m256 vf[C];
    widen(vp + off, vsc[off / D], vf);
    const auto [r0, r1] = seeing(it, pos, G, lay.window);
    for (int64_t r = r0; r < r1; ++r) {
      const __m256 p = _mm256_set1_ps(buf.probs[r * L + pos - it.first]);
      float* a = buf.acc.data() + r * D;
#pragma GCC unroll 32
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(a + 8 * c, _mm256_fmadd_ps(p, vf[c], _mm256_loadu_ps(a + 8 * c)));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    T* orow = op + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(buf.acc[r * D + d] * buf.inv[r]);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define LEVERLAB_ATTN_Q8_I16 1
// The int8 cache with 16-bit activations on AVX2 machines (Zen 1-3, Haswell..Skylake client): item_q8_vnni's
// integer arithmetic in 256-bit vectors, where vpmaddwd (16 int16 products summed pairwise into 8 int32 lanes)
// stands in for vpdpwssd. item_q8 above widens every int8 element to float32 (three instructions per 8) and
// accumulates its values in memory; here, as in item_bf16's AVX2 form, the accumulators stay in registers:
//   scores: queries as int16 (queries_i16); NP positions x NR rows of int32 sums in registers (NR = 3 for a GQA
//           group of 3, else 2, a last odd row alone), each K chunk of 16 elements sign-extended once for the NR
//           rows; the NP sums of a row reduced together by one horizontal-add tree, then times the positions' K
//           scales and the row's query scale. The first rows' pass also gathers the K/V scales, requested with
//           the rows (gathered in a loop of their own first, they waited a memory latency per block: 10-12% of the
//           kernel's time over scattered blocks).
//   values: per row and group of kGroupI16 positions, the weights p_t * vscale_t as int16 at the group's own
//           scale (max / 32767, as item_q8_vnni), two positions' V rows interleaved as int16 pairs so one vpmaddwd
//           adds both positions' products; 32 output elements x NR rows in registers over the group, whose V rows
//           stay in L1 for the next 32 elements; each group's int32 sums are scaled into float32 ones.
// On a Zen 1 (256-bit ops in two halves) vpmaddwd's 16 products take the one multiply pipe what two FMAs' take two,
// so the gain over the bf16 cache is the bytes and the fewer widening ops: attention alone, see docs/quantization.md
// (its KV-cache section).
// Bounds: a score lane sums at most D / 8 pair products of 32767 * 127 * 2 (and the tree D of them: under 2^31 for
// D <= 256); a value lane at most 32 positions' products (32 * 32767 * 127 < 2^28).
// Float32 activations keep item_q8, where the tests hold the int8 cache to 1e-5 of the gather path.
constexpr int64_t kGroupI16 = 32;

// Rows r .. r + NR - 1 (q rows q, q + D, ..; NR <= 3) against the NP positions whose K rows are krow[0 .. NP):
// their scores times ks[i] (the positions' K scales) and qs[j] (the rows' query scales) into s + j * ld.
template <int C, int NR, int NP>
inline void scores_block_i16(const int8_t* const* krow, const int16_t* q, const float* ks, const float* qs, float* s,
                             int64_t ld) {
  static_assert(NR * NP <= 12 && NP % 4 == 0, "up to twelve accumulators, reduced four at a time");
  constexpr int D = 16 * C;
  __m256i a[NR][NP];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) a[j][i] = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) {
      const __m256i k = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(krow[i] + 16 * c)));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
        a[j][i] = _mm256_add_epi32(
            a[j][i], _mm256_madd_epi16(k, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * D + 16 * c))));
    }
  }
  // Four accumulators -> their four sums, as scores_block does in float32.
  auto four = [](const __m256i* v) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  };
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    const __m128 qsj = _mm_set1_ps(qs[j]);
#pragma GCC unroll 2
    for (int i = 0; i < NP; i += 4)
      _mm_storeu_ps(s + j * ld + i, _mm_mul_ps(_mm_cvtepi32_ps(four(a[j] + i)), _mm_mul_ps(_mm_loadu_ps(ks + i), qsj)));
  }
}

// Rows r .. r + NR - 1 (NR <= 3) of P V over the group's positions [p0, p1), output elements [32 d, 32 d + 32):
// int16 weights w + j * ld (indexed by position; zero from L to the group's end, so an odd last position pairs its
// row with itself at weight 0), the group's scales ws[j * ws_ld], added into acc + j * D at 32 d. Within each
// 128-bit lane k of a 16-element chunk h, `lo` holds elements 16 h + 8 k + 0..3 of both positions interleaved and
// `hi` 16 h + 8 k + 4..7, so the float sums are kept in that order: acc[32 d + 8 m], m = 2 h + (0 lo, 1 hi).
template <int D, int NR>
inline void values_block_i16(const int8_t* vp, const int64_t* offs, const int16_t* w, int64_t ld, int64_t p0,
                             int64_t p1, int64_t L, int d, const float* ws, int64_t ws_ld, float* acc,
                             int64_t fetch_end) {
  __m256i a[NR][4];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) a[j][m] = _mm256_setzero_si256();
  for (int64_t i = p0; i < p1; i += 2) {
    if (i + kAhead + 1 < fetch_end) {
      prefetch_row_l1(vp + offs[i + kAhead], D);
      prefetch_row_l1(vp + offs[i + kAhead + 1], D);
    }
    const int8_t* va = vp + offs[i] + 32 * d;
    const int8_t* vb = vp + offs[std::min(i + 1, L - 1)] + 32 * d;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(va + 16 * h)));
      const __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vb + 16 * h)));
      const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        int32_t pair;  // the row's weights for positions i, i + 1
        std::memcpy(&pair, w + j * ld + i, 4);
        const __m256i wp = _mm256_set1_epi32(pair);
        a[j][2 * h] = _mm256_add_epi32(a[j][2 * h], _mm256_madd_epi16(lo, wp));
        a[j][2 * h + 1] = _mm256_add_epi32(a[j][2 * h + 1], _mm256_madd_epi16(hi, wp));
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    float* o = acc + j * D + 32 * d;
    const __m256 sc = _mm256_set1_ps(ws[j * ws_ld]);
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m)
      _mm256_storeu_ps(o + 8 * m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[j][m]), sc, _mm256_loadu_ps(o + 8 * m)));
  }
}

// How many rows (of n left) the next block of item_q8_i16 takes: 3 where 3 or 5+ are left (GQA 3), else 2, else 1.
inline int rows_at(int64_t n) { return n == 3 || n >= 5 ? 3 : n >= 2 ? 2 : 1; }

template <int D, typename T>
void item_q8_i16(const T* qp, const int8_t* kp, const int8_t* vp, const float* ksc, const float* vsc, T* op,
                 const Layout& lay, const Item& it, Buffers& buf) {
  static_assert(D % 32 == 0, "the value pass takes 32 elements at a time");
  constexpr int C = D / 16;  // 16-element chunks of a row
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  const int64_t NG = (L + kGroupI16 - 1) / kGroupI16, LG = NG * kGroupI16;  // rows of probs and weights: LG long
  queries_i16(qp, lay, it, R, buf);
  buf.ksf.assign(LG, 0.f);  // the positions' scales (the first rows' scores pass gathers them), 0 past L
  buf.vsf.assign(LG, 0.f);
  const int64_t* offs = buf.offs.data();
  buf.probs.resize(R * LG);
  buf.inv.resize(R);
  float* probs = buf.probs.data();
  // Scores: rows three or two at a time (4 positions a step), a last odd row alone (8 positions a step). A short
  // last block repeats its last position; its extra scores land in the row's padding and are zeroed below.
  auto scores = [&]<int NR, int NP>(int64_t r) {
    for (int64_t i0 = 0; i0 < L; i0 += NP) {
      const int8_t* krow[NP];
#pragma GCC unroll 8
      for (int i = 0; i < NP; ++i) {
        krow[i] = kp + offs[std::min<int64_t>(i0 + i, L - 1)];
        if (r == 0) {  // the first rows' pass requests K and V rows and their scales, and gathers the scales
          if (i0 + i + kAheadQ8 < L) {
            const int64_t o = offs[i0 + i + kAheadQ8];
            prefetch_row(kp + o, D);
            prefetch_row(vp + o, D);
            __builtin_prefetch(ksc + o / D, 0, 2);  // a third stream, as cold as the rows: gathered in one loop
            __builtin_prefetch(vsc + o / D, 0, 2);  // before this pass, they had waited a latency a block
          }
          if (i0 + i < L) {
            buf.ksf[i0 + i] = ksc[offs[i0 + i] / D];
            buf.vsf[i0 + i] = vsc[offs[i0 + i] / D];
          }
        }
      }
      scores_block_i16<C, NR, NP>(krow, buf.q16.data() + r * D, buf.ksf.data() + i0, buf.qs.data() + r,
                                  probs + r * LG + i0, LG);
    }
  };
  int64_t r = 0;
  for (; r < R; r += rows_at(R - r)) {
    if (rows_at(R - r) == 3) scores.template operator()<3, 4>(r);
    else if (rows_at(R - r) == 2) scores.template operator()<2, 4>(r);
    else scores.template operator()<1, 8>(r);
  }
  softmax_rows(probs, buf.inv.data(), it, R, G, LG, lay.window);
  // Weights: p_t * vscale_t, 0 where the row does not see t and past L, as int16 per group at max / 32767 (one
  // scale per row would round every weight under 1/65534 of the row's largest to 0: see item_q8_vnni).
  buf.w16.resize(R * LG);
  buf.ws.resize(R * NG);
  for (r = 0; r < R; ++r) {
    const auto [lo, e] = visible_positions(it, r, G, lay.window);
    float* p = probs + r * LG;
    std::fill(p, p + (lo - it.first), 0.f);
    std::fill(p + (e - it.first), p + LG, 0.f);
    for (int64_t g = 0; g < NG; ++g) {
      const int64_t i0 = g * kGroupI16;
      __m256 w[4];
      __m256 mx = _mm256_setzero_ps();  // weights are >= 0
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        w[k] = _mm256_mul_ps(_mm256_loadu_ps(p + i0 + 8 * k), _mm256_loadu_ps(buf.vsf.data() + i0 + 8 * k));
        mx = _mm256_max_ps(mx, w[k]);
      }
      const float wmax = hmax8(mx);
      const __m256 inv = _mm256_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
#pragma GCC unroll 2
      for (int k = 0; k < 4; k += 2) {  // packs interleaves 128-bit lanes: put them back in position order
        const __m256i x = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[k], inv)),
                                             _mm256_cvtps_epi32(_mm256_mul_ps(w[k + 1], inv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.w16.data() + r * LG + i0 + 8 * k),
                            _mm256_permute4x64_epi64(x, 0xD8));
      }
      buf.ws[r * NG + g] = wmax / 32767.f;
    }
  }
  // Values: group by group, 32 output elements at a time.
  buf.acc.assign(R * D, 0.f);  // per row, in values_block_i16's lane order
  const int16_t* w16 = buf.w16.data();
  for (int64_t g = 0; g < NG; ++g) {
    const int64_t p0 = g * kGroupI16, p1 = std::min(L, p0 + kGroupI16);
    for (r = 0; r < R; r += rows_at(R - r))
      for (int d = 0; d < D / 32; ++d) {
        const int64_t fetch_end = r == 0 && d == 0 ? L : 0;
        const int16_t* w = w16 + r * LG;
        const float* ws = buf.ws.data() + r * NG + g;
        float* acc = buf.acc.data() + r * D;
        if (rows_at(R - r) == 3)
          values_block_i16<D, 3>(vp, offs, w, LG, p0, p1, L, d, ws, NG, acc, fetch_end);
        else if (rows_at(R - r) == 2)
          values_block_i16<D, 2>(vp, offs, w, LG, p0, p1, L, d, ws, NG, acc, fetch_end);
        else
          values_block_i16<D, 1>(vp, offs, w, LG, p0, p1, L, d, ws, NG, acc, fetch_end);
      }
  }
  for (r = 0; r < R; ++r) {
    T* orow = op + ((it.row0 + r / G) * lay.H + it.h * G + r % G) * D;
    const float* a = buf.acc.data() + r * D;
    const float f = buf.inv[r];
    for (int c = 0; c < D / 16; ++c)  // chunk c: lanes m = 2 (c % 2) (lo) and + 1 (hi) of slab c / 2
      for (int x = 0; x < 8; ++x) {
        const int e = 16 * c + (x < 4 ? x : x + 4);  // lane x of lo; the same lane of hi is e + 4
        orow[e] = static_cast<T>(a[16 * c + x] * f);
        orow[e + 4] = static_cast<T>(a[16 * c + 8 + x] * f);
      }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LEVERLAB_ATTN_Q8_512 1
// The int8 cache in AVX-512, as item_bf16 above reads a bf16 one: a row's 16 int8 elements widen to float32 in
// two instructions, once per row, so K and V are read and widened once for every query row of the GQA group,
// and a row's scale is applied once per score and once per weight, not per element: s (q . k) and (p s) v,
// where the gather path computes q . (k s) and p (v s) (the same up to float32 rounding: a third fewer ops).
//   scores: per position, each row's D/16 FMAs into one vector, stored aside; 16 positions' vectors are then
//           reduced together (hsum16) where the AVX2 loop above did one horizontal sum per score
//   values: kRows rows at a time with their accumulators in registers, each V row widened once for all of them
//           (the AVX2 loop kept its accumulators in memory: a load, an FMA and a store per 8 elements)
// In one process against item_q8 (a Zen 4, one thread, hot in the caches): 1.1-1.2x at 16 x 1,000 tokens of
// either model's heads, 1.3x for one sequence of 512 (the 0.6B shape's).
template <int D, typename T>
void item_q8_512(const T* qp, const int8_t* kp, const int8_t* vp, const float* ksc, const float* vsc, T* op,
                 const Layout& lay, const Item& it, Buffers& buf) {
  constexpr int C = D / 16;  // 16-element chunks of a row
  constexpr int kRows = D <= 64 ? 4 : D <= 128 ? 2 : 1;  // value accumulators (kRows + 1) * C <= 32 registers
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  scaled_queries(qp, lay, it, R, buf);
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  buf.part.resize(R * 16 * 16);  // per row, 16 positions' unreduced score vectors
  auto widen = [](const int8_t* p, __m512* out) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
      out[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c))));
  };
  // Scores: every row for every position (a row's scores past what it sees are computed and never read, as in
  // item_bf16).
  float* part = buf.part.data();
  for (int64_t p0 = it.first; p0 < it.ctx; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, it.ctx - p0));
    alignas(64) float kscale[16] = {};
    for (int i = 0; i < n; ++i) {
      if (p0 + i + kAhead < it.ctx) {
        prefetch_row(kp + buf.offs[p0 + i + kAhead - it.first], D);
        prefetch_row(vp + buf.offs[p0 + i + kAhead - it.first], D);
      }
      const int64_t off = buf.offs[p0 + i - it.first];
      kscale[i] = ksc[off / D];
      __m512 kf[C];
      widen(kp + off, kf);
      for (int64_t r = 0; r < R; ++r) {
        const float* qf = buf.qf.data() + r * D;
        __m512 s0 = _mm512_mul_ps(kf[0], _mm512_loadu_ps(qf));
#pragma GCC unroll 16
        for (int c = 1; c < C; ++c) s0 = _mm512_fmadd_ps(kf[c], _mm512_loadu_ps(qf + 16 * c), s0);
        _mm512_storeu_ps(part + (r * 16 + i) * 16, s0);
      }
    }
    const __m512 ks = _mm512_load_ps(kscale);
    for (int64_t r = 0; r < R; ++r) {
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = i < n ? _mm512_loadu_ps(part + (r * 16 + i) * 16) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(buf.probs.data() + r * L + p0 - it.first, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(hsum16(a), ks));
    }
  }
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  for (int64_t r = 0; r < R; r += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, R - r));
    int64_t lo[kRows], e[kRows], plo = it.ctx, phi = it.first;
    for (int j = 0; j < nr; ++j) {
      std::tie(lo[j], e[j]) = visible_positions(it, r + j, G, lay.window);
      plo = std::min(plo, lo[j]), phi = std::max(phi, e[j]);
    }
    __m512 acc[kRows][C];
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t pos = plo; pos < phi; ++pos) {
      if (pos + kAhead < phi) prefetch_row_l1(vp + buf.offs[pos + kAhead - it.first], D);  // as item_bf16's V pass
      const int64_t off = buf.offs[pos - it.first];
      const float vs = vsc[off / D];
      __m512 vf[C];
      widen(vp + off, vf);
#pragma GCC unroll 4
      for (int j = 0; j < kRows; ++j) {
        if (j >= nr || pos < lo[j] || pos >= e[j]) continue;
        const __m512 w = _mm512_set1_ps(buf.probs[(r + j) * L + pos - it.first] * vs);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(w, vf[c], acc[j][c]);
      }
    }
    for (int j = 0; j < nr; ++j) {
      alignas(64) float out[D];
      const __m512 inv = _mm512_set1_ps(buf.inv[r + j]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) _mm512_store_ps(out + 16 * c, _mm512_mul_ps(acc[j][c], inv));
      const int64_t rr = r + j;
      T* orow = op + ((it.row0 + rr / G) * lay.H + it.h * G + rr % G) * D;
      for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(out[d]);
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LEVERLAB_ATTN_Q8_VNNI 1
// The int8 cache with 16-bit queries and weights (bfloat16 or float16 activations): both passes in integer dot
// products (vpdpwssd: 32 int16 products summed pairwise into 16 int32 lanes), where item_q8_512 widens every int8
// element to float32 (two instructions per 16) and spends one FMA per 16 products.
//   scores: each query row quantized to int16 (scale max|q| / 32767, a relative step of 2^-15 where bfloat16 itself
//           keeps 2^-8); a block of 16 positions' K rows sign-extended to int16 once (one instruction per 32
//           elements) into an L1 buffer, then per row 16 positions' int32 sums in registers, reduced together.
//   values: per row the probabilities times the rows' V scales, quantized to int16 in groups of 32 positions
//           (a scale each), and two positions' V rows interleaved as int16 pairs, so one vpdpwssd adds both
//           positions' products for 16 elements of a row; each group's int32 sums are scaled into float32 ones.
// Attention alone over 8 layers of 16 x 1,000 tokens, cold (a Zen 4, one thread): the bundled model's
// heads 4.5-5.0 ms a step where item_q8_512 took 8.2-8.9 and the bf16 cache's item_bf16 6.5-7.3 (1.4x it in the
// same run); the 0.6B shape's heads 1.5x item_bf16 (they were 1.3x with item_q8_512). Within the
// output's bfloat16 rounding of float32 math (tests/quant/test_kv_cache.py). The float32 path (item_q8_512) stays
// for float32 activations, where the tests hold the int8 cache to 1e-5 of the gather path.
template <int D, typename T>
void item_q8_vnni(const T* qp, const int8_t* kp, const int8_t* vp, const float* ksc, const float* vsc, T* op,
                  const Layout& lay, const Item& it, Buffers& buf) {
  constexpr int C = D / 32;  // 32-element int16 chunks of a row
  constexpr int kRows = D <= 64 ? 4 : D <= 128 ? 2 : 1;  // value accumulators 2 * C * kRows <= 16 registers
  const int64_t G = lay.G, R = it.nq * G, L = it.ctx - it.first;
  queries_i16(qp, lay, it, R, buf);
  buf.probs.resize(R * L);
  buf.inv.resize(R);
  alignas(64) int16_t kw[16][D];
  for (int64_t p0 = it.first; p0 < it.ctx; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, it.ctx - p0));
    alignas(64) float kscale[16];
    for (int i = 0; i < 16; ++i) {  // a short last block repeats its last row (as item_bf16), never stored
      if (i < n && p0 + i + kAheadQ8 < it.ctx) {
        const int64_t o = buf.offs[p0 + i + kAheadQ8 - it.first];
        prefetch_row(kp + o, D);
        prefetch_row(vp + o, D);
        __builtin_prefetch(ksc + o / D, 0, 2);  // the scales too: they are a third stream, as cold as the rows
        __builtin_prefetch(vsc + o / D, 0, 2);
      }
      const int64_t off = buf.offs[p0 + std::min(i, n - 1) - it.first];
      kscale[i] = ksc[off / D];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm512_store_si512(kw[i] + 32 * c,
                           _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + off + 32 * c))));
    }
    const __m512 ks = _mm512_load_ps(kscale);
    for (int64_t r = 0; r < R; ++r) {
      __m512i qv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(buf.q16.data() + r * D + 32 * c);
      __m512 s[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        __m512i a = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) a = _mm512_dpwssd_epi32(a, qv[c], _mm512_load_si512(kw[i] + 32 * c));
        s[i] = _mm512_cvtepi32_ps(a);
      }
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(hsum16(s), ks), _mm512_set1_ps(buf.qs[r]));
      _mm512_mask_storeu_ps(buf.probs.data() + r * L + p0 - it.first, static_cast<__mmask16>((1u << n) - 1), v);
    }
  }
  softmax_rows(buf.probs.data(), buf.inv.data(), it, R, G, L, lay.window);
  // Per row and group of kGroup positions: w_t = p_t * vscale_t (0 where the row does not see t, and past L) as
  // int16 at the group's own scale, max w / 32767. One scale per row had rounded every weight under 1/65534 of the
  // row's largest to 0: a long tail's whole mass (a row with a sink at 1 and 32K positions at 1e-5 would lose a
  // quarter of its output). Per group a weight is lost only under 1/65534 of its group's largest, at most
  // 16 / 32767 of the group's mass, and a group's int32 sums stay far from overflow (32 * 32767 * 127 < 2^28).
  constexpr int kGroup = 32;
  const int64_t NG = (L + kGroup - 1) / kGroup, LG = NG * kGroup;
  buf.vsf.resize(LG);
  for (int64_t i = 0; i < L; ++i) buf.vsf[i] = vsc[buf.offs[i] / D];
  buf.w16.resize(R * LG);
  buf.ws.resize(R * NG);
  for (int64_t r = 0; r < R; ++r) {
    const auto [lo, e] = visible_positions(it, r, G, lay.window);
    const float* p = buf.probs.data() + r * L;
    for (int64_t g = 0; g < NG; ++g) {
      const int64_t i0 = g * kGroup;
      __m512 w[2];
      for (int h = 0; h < 2; ++h) {  // lanes of positions i0 + 16h .. + 15 the row sees (all below L)
        const int64_t a = i0 + 16 * h - (lo - it.first), z = (e - it.first) - (i0 + 16 * h);
        const uint32_t from = a >= 0 ? 0xFFFFu : a <= -16 ? 0u : (0xFFFFu << -a) & 0xFFFFu;
        const uint32_t upto = z >= 16 ? 0xFFFFu : z <= 0 ? 0u : (1u << z) - 1;
        const __mmask16 m = static_cast<__mmask16>(from & upto);
        w[h] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + i0 + 16 * h), _mm512_maskz_loadu_ps(m, buf.vsf.data() + i0 + 16 * h));
      }
      const float wmax = _mm512_reduce_max_ps(_mm512_max_ps(w[0], w[1]));  // weights are >= 0
      const float sc = wmax / 32767.f, inv = wmax > 0.f ? 32767.f / wmax : 0.f;
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.w16.data() + r * LG + i0 + 16 * h),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w[h], _mm512_set1_ps(inv)))));
      buf.ws[r * NG + g] = sc;
    }
  }
  // Two positions' V rows a step, as int16 pairs: within each 128-bit lane k of chunk c, `lo` holds elements
  // 32c + 8k + 0..3 of both rows interleaved, `hi` elements 32c + 8k + 4..7; a row's weight pair is one int32.
  for (int64_t r = 0; r < R; r += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, R - r));
    alignas(64) float accf[kRows][2 * C][16] = {};  // float32 sums over the groups, in the lanes' order
    for (int64_t g = 0; g < NG; ++g) {
      __m512i acc[kRows][2 * C];
#pragma GCC unroll 4
      for (int j = 0; j < kRows; ++j)
#pragma GCC unroll 16
        for (int c = 0; c < 2 * C; ++c) acc[j][c] = _mm512_setzero_si512();
      const int64_t iend = std::min(L, (g + 1) * kGroup);
      for (int64_t i = g * kGroup; i < iend; i += 2) {
        if (i + kAhead + 1 < L) {
          prefetch_row_l1(vp + buf.offs[i + kAhead], D);
          prefetch_row_l1(vp + buf.offs[i + kAhead + 1], D);
        }
        const int8_t* va = vp + buf.offs[i];
        const int8_t* vb = vp + buf.offs[std::min(i + 1, L - 1)];  // an odd tail pairs its row with itself, weight 0
        __m512i wp[kRows];
#pragma GCC unroll 4
        for (int j = 0; j < kRows; ++j) {
          int32_t pair = 0;
          if (j < nr) std::memcpy(&pair, buf.w16.data() + (r + j) * LG + i, 4);
          wp[j] = _mm512_set1_epi32(pair);
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 32 * c)));
          const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 32 * c)));
          const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 4
          for (int j = 0; j < kRows; ++j) {
            acc[j][2 * c] = _mm512_dpwssd_epi32(acc[j][2 * c], lo, wp[j]);
            acc[j][2 * c + 1] = _mm512_dpwssd_epi32(acc[j][2 * c + 1], hi, wp[j]);
          }
        }
      }
      for (int j = 0; j < nr; ++j) {
        const __m512 sc = _mm512_set1_ps(buf.ws[(r + j) * NG + g]);
#pragma GCC unroll 16
        for (int c = 0; c < 2 * C; ++c)
          _mm512_store_ps(accf[j][c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][c]), sc, _mm512_load_ps(accf[j][c])));
      }
    }
    for (int j = 0; j < nr; ++j) {
      const int64_t rr = r + j;
      const float f = buf.inv[rr];
      T* orow = op + ((it.row0 + rr / G) * lay.H + it.h * G + rr % G) * D;
      for (int c = 0; c < C; ++c)
        for (int k = 0; k < 4; ++k)
          for (int x = 0; x < 4; ++x) {
            orow[32 * c + 8 * k + x] = static_cast<T>(accf[j][2 * c][4 * k + x] * f);
            orow[32 * c + 8 * k + 4 + x] = static_cast<T>(accf[j][2 * c + 1][4 * k + x] * f);
          }
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define LEVERLAB_ATTN_TILED 1
// Long spans (prefill chunks), AVX2: the decode loops above take one position at a time and finish every q.k
// with a horizontal sum, which suits a few query rows; a 512-token chunk has 1,536 rows per KV head (GQA 3)
// and wants register tiles instead. Per item, the context's K rows are widened to float32 once, transposed in
// tiles of 8 positions ([D][8]), and its V rows widened once; then per tile of kQT queries:
//   scores: 4 query rows x 16 positions per micro-tile, D broadcast-FMAs, no horizontal sums; only the keys the
//           tile's last query sees (causal: the upper triangle past the tile is skipped)
//   softmax: per row over its own visible range (the diagonal tile is masked here)
//   values:  in blocks of positions that stay in L1, per row D/8 accumulators in registers
// Float32 throughout, the same exp as the decode path.
constexpr int64_t kQT = 16;  // queries per tile: with GQA 3, 48 score rows of up to a few thousand positions
constexpr int64_t kMinTiledSpan = 32;  // shorter spans keep the per-position loops

struct TiledBuffers {
  std::vector<float> kt, vf, qf, scores, acc, inv;
  std::vector<int64_t> lim;  // per score row: its first and one-past-last visible position
};

// Scores of one row for `tiles` tiles of 8 positions from c (the remainder of the 4-row micro-tiles).
inline void score_row_8(TiledBuffers& tb, int64_t D, int64_t W, int64_t lo8, int64_t r, int64_t c, int tiles) {
  const float* q0 = tb.qf.data() + r * D;
  for (int t = 0; t < tiles; ++t) {
    const float* kt = tb.kt.data() + (c / 8 + t) * D * 8;
    __m256 s0 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) s0 = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + d), _mm256_loadu_ps(kt + d * 8), s0);
    _mm256_storeu_ps(tb.scores.data() + r * W + (c + 8 * t - lo8), s0);
  }
}

template <typename T, typename C>
void item_tiled(const T* qp, const C* kp, const C* vp, const float* ksc, const float* vsc, T* op,
                const Layout& lay, const Item& it, Buffers& buf, TiledBuffers& tb) {
  const int64_t D = lay.D, G = lay.G, L = it.ctx - it.first, L8 = (L + 7) / 8 * 8;
  tb.kt.assign(L8 * D, 0.f);  // [L8 / 8][D][8]: zero past L, so a partial last tile adds nothing
  tb.vf.resize(L * D);
  std::vector<float> row(D);
  for (int64_t i = 0; i < L; ++i) {
    const float* kf = row_as_float(kp, ksc, buf.offs[i], D, row.data());
    float* t = tb.kt.data() + (i / 8) * D * 8 + i % 8;
    for (int64_t d = 0; d < D; ++d) t[d * 8] = kf[d];
    float* vdst = tb.vf.data() + i * D;
    const float* vf = row_as_float(vp, vsc, buf.offs[i], D, vdst);
    if (vf != vdst) std::memcpy(vdst, vf, D * sizeof(float));  // a float32 cache's row, used in place
  }
  for (int64_t j0 = 0; j0 < it.nq; j0 += kQT) {
    const int64_t j1 = std::min(it.nq, j0 + kQT), R = (j1 - j0) * G;
    // Positions (relative to it.first) the tile's queries see: [lo, hi)
    const int64_t hi = it.pos0 + j1 - it.first;
    const int64_t lo = lay.window > 0 ? std::max<int64_t>(0, it.pos0 + j0 + 1 - lay.window - it.first) : 0;
    const int64_t lo8 = lo / 8 * 8, W = (hi + 7) / 8 * 8 - lo8;  // score columns, in whole key tiles
    tb.qf.resize(R * D);
    tb.scores.resize(R * W);
    for (int64_t r = 0; r < R; ++r) {
      const T* q = qp + ((it.row0 + j0 + r / G) * lay.H + it.h * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) tb.qf[r * D + d] = static_cast<float>(q[d]) * lay.scale;
    }
    int64_t c = lo8;
    for (; c + 16 <= lo8 + W; c += 16) {  // 4 rows x 16 positions: 2 loads and 4 broadcasts per 8 FMAs
      const float* ka = tb.kt.data() + (c / 8) * D * 8;
      const float* kb = ka + D * 8;
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) {
        const float* q0 = tb.qf.data() + r * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t d = 0; d < D; ++d) {
          const __m256 x = _mm256_loadu_ps(ka + d * 8), y = _mm256_loadu_ps(kb + d * 8);
          __m256 qv = _mm256_broadcast_ss(q0 + d);
          a0 = _mm256_fmadd_ps(qv, x, a0);
          b0 = _mm256_fmadd_ps(qv, y, b0);
          qv = _mm256_broadcast_ss(q0 + D + d);
          a1 = _mm256_fmadd_ps(qv, x, a1);
          b1 = _mm256_fmadd_ps(qv, y, b1);
          qv = _mm256_broadcast_ss(q0 + 2 * D + d);
          a2 = _mm256_fmadd_ps(qv, x, a2);
          b2 = _mm256_fmadd_ps(qv, y, b2);
          qv = _mm256_broadcast_ss(q0 + 3 * D + d);
          a3 = _mm256_fmadd_ps(qv, x, a3);
          b3 = _mm256_fmadd_ps(qv, y, b3);
        }
        float* out = tb.scores.data() + r * W + (c - lo8);
        _mm256_storeu_ps(out, a0);
        _mm256_storeu_ps(out + 8, b0);
        _mm256_storeu_ps(out + W, a1);
        _mm256_storeu_ps(out + W + 8, b1);
        _mm256_storeu_ps(out + 2 * W, a2);
        _mm256_storeu_ps(out + 2 * W + 8, b2);
        _mm256_storeu_ps(out + 3 * W, a3);
        _mm256_storeu_ps(out + 3 * W + 8, b3);
      }
      for (; r < R; ++r) score_row_8(tb, D, W, lo8, r, c, 2);
    }
    for (; c < lo8 + W; c += 8)  // an odd last tile of 8 positions
      for (int64_t r = 0; r < R; ++r) score_row_8(tb, D, W, lo8, r, c, 1);
    // Softmax per row over its own visible positions [a, e) (relative to it.first; the diagonal tile's
    // positions past a row's query are never read).
    tb.lim.resize(2 * R);
    tb.inv.resize(R);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t e = it.pos0 + j0 + r / G + 1 - it.first;
      const int64_t a = lay.window > 0 ? std::max<int64_t>(0, e - lay.window) : 0;
      float* p = tb.scores.data() + r * W - lo8;  // p[i] is position i's score
      tb.lim[2 * r] = a;
      tb.lim[2 * r + 1] = e;
      tb.inv[r] = softmax_span(p + a, e - a);
    }
    // Values in blocks of positions that fit in L1 (16 KB of float32 rows), each applied to every row before
    // the next: row by row over the whole context streamed every V row once per row from L2 and was the
    // slowest part.
    const int64_t KB = std::max<int64_t>(8, 4096 / D);
    tb.acc.assign(R * D, 0.f);
    for (int64_t k0 = lo; k0 < hi; k0 += KB) {
      const int64_t k1 = std::min(hi, k0 + KB);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t a = std::max(k0, tb.lim[2 * r]), e = std::min(k1, tb.lim[2 * r + 1]);
        if (a >= e) continue;
        const float* p = tb.scores.data() + r * W - lo8;
        float* acc_row = tb.acc.data() + r * D;
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {  // 8 accumulators of 8 in registers
          __m256 acc[8];
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(acc_row + d0 + 8 * c);
          for (int64_t i = a; i < e; ++i) {
            const __m256 w = _mm256_set1_ps(p[i]);
            const float* v = tb.vf.data() + i * D + d0;
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
          }
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc_row + d0 + 8 * c, acc[c]);
        }
        for (; d0 < D; ++d0)  // a head size that is not a multiple of 64: the rest in plain loops
          for (int64_t i = a; i < e; ++i) acc_row[d0] += p[i] * tb.vf[i * D + d0];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      T* orow = op + ((it.row0 + j0 + r / G) * lay.H + it.h * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(tb.acc[r * D + d] * tb.inv[r]);
    }
  }
}
#endif

// T: q and out; C: the cache's elements (T, or int8 with ksc/vsc its scales [num_blocks * block_size * KVH]).
// done (or null): sequences whose rows of `out` are already written (fresh_spans), skipped here.
template <typename T, typename C>
void spans_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const float* ksc,
                const float* vsc, const at::Tensor& block_tables, const at::Tensor& seq_lens, const int64_t* qsl,
                double scale, int64_t window, at::Tensor& out, const char* done = nullptr) {
  const int64_t B = seq_lens.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const CacheStrides cs(k_cache);
  const Layout lay{H, D, BS, KVH, H / KVH, block_tables.size(1), cs.tok, cs.head, cs.blk,
                   block_tables.data_ptr<int64_t>(), window, static_cast<float>(scale)};
  const T* qp = q.data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    Buffers buf;
#if defined(LEVERLAB_ATTN_TILED)
    TiledBuffers tb;
#endif
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, ctx = lens[b], nq = qsl[b + 1] - qsl[b];
      if (done != nullptr && done[b]) continue;
      const int64_t pos0 = ctx - nq;  // position of the span's first query
      const Item it{b, i % KVH, ctx, qsl[b], nq, pos0, window > 0 ? std::max<int64_t>(0, pos0 + 1 - window) : 0};
      row_offsets(lay, it, buf);
#if defined(LEVERLAB_ATTN_TILED)
      if (nq >= kMinTiledSpan) { item_tiled(qp, kp, vp, ksc, vsc, op, lay, it, buf, tb); continue; }
#endif
      if constexpr (std::is_same_v<C, int8_t>) {
#if defined(LEVERLAB_ATTN_Q8_VNNI)
        if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
          if (D == 64) { item_q8_vnni<64>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
          if (D == 128) { item_q8_vnni<128>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
          if (D == 256) { item_q8_vnni<256>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
        }
#endif
#if defined(LEVERLAB_ATTN_Q8_I16)
        if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
          if (D == 64) { item_q8_i16<64>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
          if (D == 128) { item_q8_i16<128>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
          if (D == 256) { item_q8_i16<256>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
        }
#endif
#if defined(LEVERLAB_ATTN_Q8_512)
        if (D == 64) { item_q8_512<64>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
        if (D == 128) { item_q8_512<128>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
        if (D == 256) { item_q8_512<256>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
#elif defined(LEVERLAB_ATTN_Q8)
        if (D == 64) { item_q8<64>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
        if (D == 128) { item_q8<128>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
        if (D == 256) { item_q8<256>(qp, kp, vp, ksc, vsc, op, lay, it, buf); continue; }
#endif
      } else {
#if defined(__AVX512BF16__) || defined(LEVERLAB_ATTN_AVX2)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          auto u = [](auto* p) { return reinterpret_cast<uint16_t*>(const_cast<T*>(p)); };
          if (D == 64) { item_bf16<64>(u(qp), u(kp), u(vp), u(op), lay, it, buf); continue; }
          if (D == 128) { item_bf16<128>(u(qp), u(kp), u(vp), u(op), lay, it, buf); continue; }
          if (D == 256) { item_bf16<256>(u(qp), u(kp), u(vp), u(op), lay, it, buf); continue; }
        }
#endif
      }
      item_generic(qp, kp, vp, ksc, vsc, op, lay, it, buf);
    }
  });
}

// Fresh prefill spans in bfloat16 on a CPU with AMX: a sequence whose whole context is new (no cached prefix),
// kMinSdpaSpan queries or more, no window. PyTorch's CPU flash attention (at::scaled_dot_product_attention) runs
// its two products on AMX tiles through oneDNN's brgemm, where item_tiled above runs AVX2 FMAs in float32: one
// thread, one process, the two alternating (the 0.6B shape's heads, 16 query / 8 KV, D 128): 39 against 141 ms at
// 1,024 tokens, 1.7 against 15.9 ms at 256; the bundled model's (6 / 2, D 64) at 1,500 tokens 15.8 against 84 ms.
// Its K/V are the span's own new rows, so nothing is gathered from the cache. Returns, per sequence, whether its
// rows of `out` are written (all zeros when the path does not apply). The products round P to bfloat16 as any
// bf16 attention does; float32 models and spans with a cached prefix keep the float32 kernels.
// Where the head size suits the tiles (a multiple of 32), our own AMX kernel (amx_attention.cpp) takes the span
// instead of PyTorch's (scripts/bench_prefill_attention.py, one thread, that Xeon): the 0.6B shape's heads 9.9
// against 14.3 ms at 1,024 tokens, 1.1 against 4.5 at 333; the bundled model's 4.1 against 6.3 ms at 1,500. SDPA
// stays for other head sizes.
constexpr int64_t kMinSdpaSpan = 64;

std::vector<char> fresh_spans(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const int64_t* lens, const int64_t* qsl, int64_t B, double scale, int64_t window,
                                   at::Tensor& out) {
  std::vector<char> done(B, 0);
  if (q.scalar_type() != at::kBFloat16 || window > 0 || !amx_bf16_enabled()) return done;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = qsl[b], n = qsl[b + 1] - qsl[b];
    if (n != lens[b] || n < kMinSdpaSpan) continue;
    if (amx_attention_takes(q.size(2))) {
      amx_fresh_attention(q.narrow(0, s, n), k.narrow(0, s, n), v.narrow(0, s, n), out.narrow(0, s, n), scale);
      done[b] = 1;
      continue;
    }
    // [n, heads, D] -> [1, heads, n, D] views; GQA: each KV head serves H / KVH query heads
    const at::Tensor qb = q.narrow(0, s, n).transpose(0, 1).unsqueeze(0);
    const at::Tensor kb = k.narrow(0, s, n).transpose(0, 1).unsqueeze(0);
    const at::Tensor vb = v.narrow(0, s, n).transpose(0, 1).unsqueeze(0);
    const at::Tensor o = at::scaled_dot_product_attention(qb, kb, vb, {}, 0.0, /*is_causal=*/true, scale,
                                                          /*enable_gqa=*/kb.size(1) != qb.size(1));
    out.narrow(0, s, n).copy_(o.squeeze(0).transpose(0, 1));
    done[b] = 1;
  }
  return done;
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                        int64_t window, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale) {
  // Either layout (CacheStrides), the same for K and V; K/V rows of D contiguous elements that no two slots share.
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && k_cache.is_non_overlapping_and_dense() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "caches [num_blocks, block_size, KVH, D], dense, with D contiguous, K and V alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "int64 metadata");
  const bool q8 = k_scale.has_value();
  TORCH_CHECK(q8 == v_scale.has_value(), "k_scale and v_scale come together");
  if (q8) {
    TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
                "scales come with an int8 cache");
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->dim() == 3 && v_scale->strides() == k_scale->strides() &&
                    k_scale->size(0) == k_cache.size(0) && k_scale->size(1) == k_cache.size(1) &&
                    k_scale->size(2) == k_cache.size(2) && v_scale->sizes() == k_scale->sizes() &&
                    k_scale->stride(0) * k_cache.size(3) == k_cache.stride(0) &&
                    k_scale->stride(1) * k_cache.size(3) == k_cache.stride(1) &&
                    k_scale->stride(2) * k_cache.size(3) == k_cache.stride(2),
                "scales: float32 [num_blocks, block_size, KVH] laid out as the cache (a row's offset / D)");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v share a dtype");
  } else {
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k.scalar_type() == k_cache.scalar_type() &&
                    v.scalar_type() == k_cache.scalar_type(), "q, k, v and the cache must share a dtype");
  }
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1, "query_start_loc has B + 1 entries");
  TORCH_CHECK(slot_mapping.numel() == k.size(0) && k.sizes() == v.sizes() && k.size(0) == q.size(0),
              "one slot and one K/V row per query");
  // K/V (and the fresh spans' Q) are read in place when each row's heads are D contiguous elements, as the
  // fused decoder's views of its qkv rows are: copying them cost a 1,024-token prefill of the 0.6B shape ~0.65 ms
  // a layer on one thread. The other spans' kernels index Q as contiguous: it is copied only for them.
  auto rows_of_heads = [](const at::Tensor& t) {
    return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  auto kc = rows_of_heads(k), vc = rows_of_heads(v), slots = slot_mapping.contiguous();
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t* starts = qsl.data_ptr<int64_t>();
  for (int64_t b = 0; b < sl.size(0); ++b)
    TORCH_CHECK(starts[b + 1] - starts[b] <= sl.data_ptr<int64_t>()[b], "a span longer than its context");
  TORCH_CHECK(starts[sl.size(0)] == q.size(0), "query_start_loc must end at the number of queries");
  auto out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (q8) {
      float* ks = k_scale->data_ptr<float>();
      float* vs = v_scale->data_ptr<float>();
      write_new_kv_q8<scalar_t>(kc, vc, k_cache, v_cache, ks, vs, slots);
      spans_impl<scalar_t, int8_t>(q.contiguous(), k_cache, v_cache, ks, vs, bt, sl, starts, scale, window, out);
    } else {
      write_new_kv<scalar_t>(kc, vc, k_cache, v_cache, slots);
      const std::vector<char> done =
          fresh_spans(rows_of_heads(q), kc, vc, sl.data_ptr<int64_t>(), starts, sl.size(0), scale, window, out);
      if (std::find(done.begin(), done.end(), 0) != done.end())
        spans_impl<scalar_t, scalar_t>(q.contiguous(), k_cache, v_cache, nullptr, nullptr, bt, sl, starts, scale,
                                       window, out, done.data());
    }
  });
  return out;
}

bool has_tiled_attention() {
#if defined(LEVERLAB_ATTN_TILED)
  return true;
#else
  return false;
#endif
}
