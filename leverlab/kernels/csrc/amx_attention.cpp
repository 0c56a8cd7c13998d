// Causal self-attention of a fresh bf16 prompt (no cached prefix) on AMX tiles: the prefill attention of a prompt
// that arrives whole, as the TTFT of a 1,500-token prompt measures it.
//
// Why: PyTorch's CPU flash attention ran the Qwen3-0.6B shape's 1,024-token prompt at ~190 G multiply-adds a second
// on one thread of a Xeon with AMX (11-12.5 ms a layer, scripts/profile_step.py's prefill phases put attention at 31%
// of the prefill), where one TDPBF16PS does 16 x 16 x 32 in ~16 cycles. Per score the tiles cost ~0.25 cycle
// (2 x D multiply-adds at D = 128); the softmax's vector work (max, exp, sum, round) ~0.5-1: that is the floor.
//
// Work item: one query head, a block of 32 query positions (two A tiles of 16 rows). Three passes, no online
// rescaling, because a prompt chunk is at most the step budget (a few thousand keys) and a score row fits in L2:
//   1. S = Q K^T, [32][Lk] float32, Lk the visible keys rounded up to 32: per 32 keys four C tiles over D / 32
//      steps (two Q tiles against two packed K tiles).
//   2. per row, over its own visible keys (causal): max, p = exp(scale S - max), sum in float32; p rounded to bf16
//      into P [32][Lk], zeros past the diagonal.
//   3. O = P V, per 32 columns of D four C tiles over Lk / 32 steps; out = O / sum, rounded to bf16 once.
// Each thread runs its items three at a time (run_items): pass 2 of one between the tile steps of the next one's
// pass 1 and the previous one's pass 3, and one KV head's items after another (start_item). The 0.6B shape's heads
// at 1,024 tokens, one thread of that Xeon (scripts/bench_prefill_attention.py): 8.1 ms a layer with the passes in
// turn, items head after head and the tile operands misaligned; 5.8 ms with the three changes. (Vector work spread
// more thinly still, a few vectors after each product, gained nothing more.)
// K and V are packed once per KV head into the tiles' VNNI order and serve its G query heads:
//   K: [n16][D/32][16 r][16 j] pairs, pair (r, j) = K[16 kb + j][32 dc + 2r .. + 1] (a 16 x 16 transpose of
//      32-bit words of K's rows), so that C[m][j] = sum_d Q[m][d] K[j][d];
//   V: [n32][D/16][16 r][16 c] pairs, pair (r, c) = (V[32 kb + 2r][16 dt + c], V[32 kb + 2r + 1][16 dt + c]).
// Zero past n in both, so padded keys add nothing.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_util.h"
#include "vec_math.h"

#if defined(LEVERLAB_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LEVERLAB_AMX_ATTN 1
#endif

bool amx_bf16_enabled();

#ifdef LEVERLAB_AMX_ATTN
namespace {

constexpr int64_t kQ = 32;  // query positions per work item (two A tiles)
constexpr int64_t kK = 32;  // keys per step of passes 1 and 3

// K rows of one KV head -> packed K (see the top). k points at K[0][h][0]; rs: elements between rows.
void pack_k(const uint16_t* k, int64_t rs, int64_t n, int64_t D, uint32_t* out) {
  const int64_t n16 = (n + 15) / 16, dcs = D / 32;
  for (int64_t kb = 0; kb < n16; ++kb)
    for (int64_t dc = 0; dc < dcs; ++dc) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t key = 16 * kb + j;
        r[j] = key < n ? _mm512_loadu_si512(k + key * rs + 32 * dc) : _mm512_setzero_si512();
      }
      amx::transpose16(r);  // r[i] lane j: key j's word i (d = 32 dc + 2i, + 1)
      uint32_t* t = out + (kb * dcs + dc) * 256;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(t + 16 * i, r[i]);
    }
}

// V rows of one KV head -> packed V (see the top), n32 = ceil(n / 32) blocks of 32 keys.
void pack_v(const uint16_t* v, int64_t rs, int64_t n, int64_t D, uint32_t* out) {
  const int64_t n32 = (n + 31) / 32, dts = D / 16;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t kb = 0; kb < n32; ++kb)
    for (int64_t dt = 0; dt < dts; ++dt) {
      uint32_t* t = out + (kb * dts + dt) * 256;
      for (int r = 0; r < 16; ++r) {
        const int64_t a = 32 * kb + 2 * r, b = a + 1;
        const __m256i va = a < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + a * rs + 16 * dt)) : zero;
        const __m256i vb = b < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + b * rs + 16 * dt)) : zero;
        const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(va), _mm512_slli_epi32(_mm512_cvtepu16_epi32(vb), 16));
        _mm512_storeu_si512(t + 16 * r, w);
      }
    }
}

// c [32][ldc] float32 (its first 32 columns) = sum over `steps` of two A tiles (rows 0-15 and 16-31 of a, ld
// elements between rows, a_step elements between steps) times two B tiles (b0 and b1, b_step words between steps):
// the 2 x 2 blocking both passes run (two A and two B tiles against four C tiles: all eight tiles). between() runs
// after each step's products are issued: vector work of another item, which the core then runs while the tiles work.
template <typename Between>
inline void product_2x2(const uint16_t* a, int64_t ld, int64_t a_step, const uint32_t* b0, const uint32_t* b1,
                        int64_t b_step, int64_t steps, float* c, int64_t ldc, Between&& between) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_loadd(4, a + i * a_step, ld * 2);
    _tile_loadd(5, a + 16 * ld + i * a_step, ld * 2);
    _tile_loadd(6, b0 + i * b_step, 64);
    _tile_loadd(7, b1 + i * b_step, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    between();
  }
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  _tile_stored(2, c + 16 * ldc, ldc * 4);
  _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

// One work item: query head hq's positions [p0, p0 + 32) against keys [0, min(n, p0 + 32)), with its scratch.
struct Item {
  amx::tile_vector<uint16_t> q;  // [kQ][D] the block's query rows, zero past n
  amx::tile_vector<float> s;     // [kQ][ss] scores
  amx::tile_vector<uint16_t> p;  // [kQ][ps] probabilities (unnormalized), bf16
  amx::tile_vector<float> o;     // [kQ][D]
  float inv[kQ];
  const uint32_t *kp, *vp;  // the KV head's packed K and V
  uint16_t* out;            // row p0's output (ors elements between rows)
  int64_t p0 = 0, rows = 0, lk = 0, ss = 0, ps = 0;
};

// Where the work items' arguments are: the whole call's tensors and sizes.
struct Args {
  const uint16_t* q;  // [n, H, D]
  int64_t qrs;
  const uint32_t *kp, *vp;  // per KV head kper words each
  int64_t kper;
  uint16_t* out;
  int64_t ors, n, H, G, D, blocks;
  float scale;
};

// Sets `it` up for item w: KV head h's blocks longest first, each block's G query heads in turn (so that one KV
// head's packed K and V, ~0.5 MB at 1,024 keys, stay in L2 over its items: taken head after head across the
// blocks, every item had read another head's from L3).
void start_item(const Args& a, int64_t w, Item& it) {
  const int64_t per_head = a.G * a.blocks, h = w / per_head, blk = a.blocks - 1 - (w % per_head) / a.G;
  const int64_t hq = h * a.G + w % a.G, D = a.D;
  it.p0 = blk * kQ;
  it.rows = std::min(kQ, a.n - it.p0);
  it.lk = (std::min(a.n, it.p0 + kQ) + kK - 1) / kK * kK;  // visible keys, rounded up to 32
  // Row strides of S and P one cache line past lk: at a multiple of 4 KB the 16 rows a tile stores or loads fall
  // in one L1 set.
  it.ss = it.lk + 16;
  it.ps = it.lk + 32;
  it.kp = a.kp + h * a.kper;
  it.vp = a.vp + h * a.kper;
  it.out = a.out + it.p0 * a.ors + hq * D;
  it.q.assign(kQ * D, 0);
  for (int64_t i = 0; i < it.rows; ++i) std::memcpy(it.q.data() + i * D, a.q + (it.p0 + i) * a.qrs + hq * D, D * 2);
  it.s.resize(kQ * it.ss);
  it.p.resize(kQ * it.ps);
  it.o.resize(kQ * D);
}

// 1. scores: rows of Q (D / 32 tiles of 32 d each) against K's tiles of each block's two groups of 16 keys
template <typename Between>
void scores(Item& it, int64_t D, Between&& between) {
  const int64_t dcs = D / 32;
  for (int64_t kb = 0; kb < it.lk / kK; ++kb)
    product_2x2(it.q.data(), D, 32, it.kp + 2 * kb * dcs * 256, it.kp + (2 * kb + 1) * dcs * 256, 256, dcs,
                it.s.data() + kb * kK, it.ss, between);
}

// 2. row i's softmax over keys [0, p0 + i]: p = exp(scale (s - max)) rounded to bf16 into P, zeros past the
// diagonal up to lk; 1 / sum (of the unrounded p) into inv[i].
void softmax_row(Item& it, int64_t i, float scale) {
  uint16_t* pr = it.p.data() + i * it.ps;
  if (i >= it.rows) {
    std::memset(pr, 0, it.lk * 2);
    it.inv[i] = 0.f;
    return;
  }
  const float* sr = it.s.data() + i * it.ss;
  const int64_t vis = it.p0 + i + 1;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= vis; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sr + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (vis - j)) - 1);
  if (j < vis) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, sr + j));
  const float sl = scale * 1.44269504088896341f;  // scale log2(e)
  const __m512 vsl = _mm512_set1_ps(sl), m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * sl);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= vis; j += 16) {
    const __m512 e = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vsl, m));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (j < vis) {
    const __m512 e =
        _mm512_maskz_mov_ps(tail, exp2_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, sr + j), vsl, m)));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    j += 16;
  }
  for (; j < it.lk; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), _mm256_setzero_si256());
  it.inv[i] = 1.f / _mm512_reduce_add_ps(vsum);
}

// 3. O = P V, 32 columns of D at a time: rows of P (32 keys a tile) against V's tiles of those columns
template <typename Between>
void values(Item& it, int64_t D, Between&& between) {
  const int64_t dts = D / 16;
  for (int64_t dt = 0; dt < dts; dt += 2)
    product_2x2(it.p.data(), it.ps, kK, it.vp + dt * 256, it.vp + (dt + 1) * 256, dts * 256, it.lk / kK,
                it.o.data() + 16 * dt, D, between);
}

// out = O / sum, rounded to bf16 once
void finish(const Item& it, int64_t D, int64_t ors) {
  for (int64_t i = 0; i < it.rows; ++i) {
    const __m512 inv = _mm512_set1_ps(it.inv[i]);
    uint16_t* dst = it.out + i * ors;
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(it.o.data() + i * D + d), inv)));
  }
}

// Items ws (start_item's numbering) on this thread, three at a time in a pipeline: while the tiles run item i's
// scores and item i - 2's values, the vector ports run item i - 1's softmax, a few rows after each tile step (the
// rows spread evenly over the steps). Run one after the other, the three passes had kept the tiles idle through the
// softmax and the vector ports through the products.
void run_items(const Args& a, const std::vector<int64_t>& ws) {
  Item items[3];
  const int64_t D = a.D, count = static_cast<int64_t>(ws.size());
  for (int64_t i = 0; i < count + 2; ++i) {
    Item* cur = i < count ? &items[i % 3] : nullptr;
    Item* mid = i >= 1 && i - 1 < count ? &items[(i - 1) % 3] : nullptr;
    Item* old = i >= 2 ? &items[(i - 2) % 3] : nullptr;
    if (cur) start_item(a, ws[i], *cur);
    // the tile steps of this round, over which mid's kQ softmax rows are spread
    const int64_t steps = (cur ? cur->lk / kK * (D / 32) : 0) + (old ? D / 32 * (old->lk / kK) : 0);
    int64_t step = 0, row = 0;
    auto between = [&] {
      ++step;
      if (mid)
        while (row < kQ && row * steps < step * kQ) softmax_row(*mid, row++, a.scale);
    };
    if (cur) scores(*cur, D, between);
    if (old) {
      values(*old, D, between);
      finish(*old, D, a.ors);
    }
    if (mid)
      while (row < kQ) softmax_row(*mid, row++, a.scale);
  }
}

}  // namespace
#endif

// Whether amx_fresh_attention takes this shape here: AMX-BF16 on (and permitted), D a multiple of 32.
bool amx_attention_takes(int64_t D) {
#ifdef LEVERLAB_AMX_ATTN
  return amx_bf16_enabled() && D % 32 == 0 && D <= 256;
#else
  (void)D;
  return false;
#endif
}

// q [n, H, D], k and v [n, KVH, D] (rows of a prompt with no cached prefix, position i attends to 0..i), out
// [n, H, D]; all bf16 with D contiguous. Query head hq reads KV head hq / (H / KVH).
void amx_fresh_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                         double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "amx_fresh_attention: bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && out.sizes() == q.sizes() &&
                  k.size(0) == q.size(0) && q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              "amx_fresh_attention: q [n, H, D], k and v [n, KVH, D] with KVH dividing H, out like q");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && k.stride(1) == k.size(2) && v.stride(1) == v.size(2) &&
                  out.stride(1) == out.size(2),
              "amx_fresh_attention: heads of D contiguous elements");
  TORCH_CHECK(amx_attention_takes(q.size(2)), "amx_fresh_attention: no AMX-BF16 here, or D not a multiple of 32");
#ifdef LEVERLAB_AMX_ATTN
  const int64_t n = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), G = H / KVH;
  if (n == 0) return;
  // 32-bit words per head, both padded to whole blocks of 32 keys (pass 1 reads K 32 keys at a time)
  const int64_t kper = (n + 31) / 32 * 32 * D / 2, vper = kper;
  amx::tile_vector<uint32_t> kp(KVH * kper), vpk(KVH * vper);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, KVH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      pack_k(kd + h * D, k.stride(0), n, D, kp.data() + h * kper);
      pack_v(vd + h * D, v.stride(0), n, D, vpk.data() + h * vper);
    }
  });
  const int64_t blocks = (n + kQ - 1) / kQ;
  const Args args{qd, q.stride(0), kp.data(), vpk.data(), kper, od, out.stride(0), n, H, G, D, blocks,
                  static_cast<float>(scale)};
  // Thread t of nt takes every nt-th block of each KV head (its G items): each thread's items stay on one head at a
  // time, and the threads end together for any number of heads.
  const int64_t total = H * blocks, nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    _tile_loadconfig(&amx::kConfig);
    std::vector<int64_t> mine;
    for (int64_t t = t0; t < t1; ++t) {
      mine.clear();
      for (int64_t w = 0; w < total; ++w)
        if ((w / G) % nt == t) mine.push_back(w);
      run_items(args, mine);
    }
    _tile_release();
  });
#else
  (void)scale;
#endif
}
