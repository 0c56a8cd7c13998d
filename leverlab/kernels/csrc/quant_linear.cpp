// Streaming int8 and int4 linears for a few activation rows (decode, verification, small batches): y = x W^T (+ b).
//
// Like the bf16 kernel (skinny_linear.cpp) each thread walks its share of W's rows as one sequential stream:
// decode reads W once per step. On a small model the quantized weights sit largely in the last-level cache, and
// then the kernel's arithmetic, not memory, sets the pace: widening every weight to float32 ran int8 at ~2.6
// weights per cycle on a Zen 3. So with bf16/fp16 activations both kernels take integer dot products, as
// llama.cpp's q8_0 x q8_0 and q4_0 x q8_0 paths do: the activations are quantized per 32-element block to int8
// (scale max|x| / 127, one rounding of at most half a step; `quantize_q8`), a block's 32 products are
// vpmaddubsw + vpmaddwd (unsigned x signed bytes, pair sums at most 2 * 128 * 127: no saturation), and one float
// FMA per block applies the scales. float32 activations (the exactness tests) keep the float path, exact against
// the dequantized weight, and so does `--quantization int8-woq` (weight-only by request).
//
// int8: W [N, K] int8 with a float32 scale per row (W ~= q * s). int4: W ~= q * s - s * z per group of g input
// channels (q, z in 0..15), packed by quant/int4.py: pack_int4_streaming: per 32-weight block of a row, 16 bytes;
// byte i holds weight i in its low nibble and weight 16 + i in its high one, so both nibble planes widen in
// order with no shuffles. A group's dot product is s * sum(q x) - s z * sum(x): the zero point costs one term per
// group, from the block sums of the (quantized) activations. s and z are stored in fp16, a row's 2G of them
// together ([N, 2, G]): at g = 64 that is 4.5 bits per weight, Q4_0's size (float32 s and s z had made it 5,
// 11% more to read per step). A single stream converts them in registers as a row reaches them (u4_rows); the
// tiles widen a weight row's once for all their activation rows (widen_scales).
// With AVX-512 VNNI an int4 model's layers stream panels of 16 weight rows instead (int4_panels_q8 below): the
// same bytes in another order, with each group's scales inside the stream.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernel_util.h"
#include "row_split.h"
#include "stream_hint.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LEVERLAB_QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LEVERLAB_QUANT_AVX512 1  // AVX-512 with VNNI (Ice Lake and later, Zen 4): int4's single stream below
#endif
#endif

// Rows up to which these kernels stream (callers hand more to batched GEMMs): 16 keeps a batch-16 decode
// step on them, the activations of 16 rows (16 KB at K = 1024) staying in L1 while each weight row is read once.
int64_t quant_max_rows() { return 16; }

namespace {

// Per-thread scratch for the widened or quantized activations: no allocation per call on the decode path.
// 64-byte aligned (a vector's data is only 16-byte aligned), so that the kernels' 512-bit loads of x never
// straddle two cache lines: in a standalone harness (hot, one process) the int4 single stream ran ~1.2x slower
// with x 16 or 48 bytes past a line than at 0 or 32, and a vector drew its offset once per process.
template <typename E>
E* scratch(std::vector<E>& v, size_t n) {
  constexpr size_t kPad = 64 / sizeof(E);
  if (v.size() < n + kPad) v.resize(n + kPad);
  const auto addr = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - addr % 64) % 64) / sizeof(E);
}

#if LEVERLAB_QUANT_AVX2
inline int32_t hsum8_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}
#endif

// ---- activations quantized per 32-element block (K % 32 == 0) ----------------------------------------------
// Row m of x -> q [m * K ..] int8, scale [m * B ..] (B = K / 32 blocks) and the block's integer sum [m * B ..].
// int4 also reads them in its pair order (pair_rows): row m's pair p (blocks 2p, 2p + 1) as 64 bytes at
// qp[m * K + 64 p] and its two block scales as one vector at sp[(m * (B / 2) + p) * 8].
struct QuantizedRows {
  const int8_t* q;
  const float* scale;
  const int32_t* sum;
  int64_t K, B;
  const int8_t* qp = nullptr;
  const float* sp = nullptr;
  const int8_t* q4 = nullptr;  // AVX-512, one row: quad order (quad_row)
  const float* sg = nullptr;  // AVX-512, one row, groups of 64 (span 2): the scale per group, G rounded up to 16
};

// span: blocks sharing one scale (max|x| over span * 32 elements; K % (32 span) == 0): 1, or 2 where an int4/int6
// weight group covers both, so that the two scales multiply once per group (u4_row_512). Every block keeps its
// own entry in scale[] (equal within a span) and its own integer sum.
template <typename T>
QuantizedRows quantize_q8(const at::Tensor& x, int span = 1) {
  static thread_local std::vector<int8_t> qbuf;
  static thread_local std::vector<float> sbuf;
  static thread_local std::vector<int32_t> ibuf;
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  int8_t* q = scratch(qbuf, M * K);
  float* sc = scratch(sbuf, M * B);
  int32_t* is = scratch(ibuf, M * B);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data_ptr<T>() + m * x.stride(0);
    for (int64_t b0 = 0; b0 < B; b0 += span) {
      alignas(32) float f[64];
      const int n = 32 * span;
      for (int i = 0; i < n; ++i) f[i] = static_cast<float>(xr[b0 * 32 + i]);
#if LEVERLAB_QUANT_AVX2
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < n / 8; ++j) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_load_ps(f + 8 * j)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
      const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
      for (int s = 0; s < span; ++s) {
        const int64_t b = b0 + s;
        int8_t* qb = q + m * K + b * 32;
        __m256i iv[4];  // round to nearest even, as std::nearbyint in the default rounding mode
        for (int j = 0; j < 4; ++j) iv[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(f + 32 * s + 8 * j), inv));
        is[m * B + b] = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3])));
        // packs work within 128-bit lanes: the dwords come out as (0-3, 8-11, 16-19, 24-27, 4-7, ...); put them back.
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                            _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        sc[m * B + b] = mx / 127.f;
      }
#else
      float mx = 0.f;
      for (int i = 0; i < n; ++i) mx = std::max(mx, std::abs(f[i]));
      const float inv = mx > 0.f ? 127.f / mx : 0.f;
      for (int s = 0; s < span; ++s) {
        const int64_t b = b0 + s;
        int8_t* qb = q + m * K + b * 32;
        int32_t isum = 0;
        for (int i = 0; i < 32; ++i) {
          qb[i] = static_cast<int8_t>(std::nearbyint(f[32 * s + i] * inv));
          isum += qb[i];
        }
        is[m * B + b] = isum;
        sc[m * B + b] = mx / 127.f;
      }
#endif
    }
  }
  return {q, sc, is, K, B};
}

#if LEVERLAB_QUANT_AVX2
inline __m256i dot_block_u4(__m256i w, __m256i x) {  // 8 int32 lanes summing the 32 products w * x, w in 0..15
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

inline __m256i load_u4_block(const uint8_t* p) {  // 16 bytes -> 32 nibbles in order (low plane, then high)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Two blocks at once (b even, b + 1): their 32 packed bytes in one load. Byte i of a block holds its weights i
// (low nibble) and 16 + i (high), so one mask gives weights 0..15 of b then of b + 1 and a shift and a mask give
// weights 16..31 of each: 1.5 ops per block where a lone block takes 3 and a 128-bit load. The activations
// are put in the same order by two lane permutes of their natural layout, once per call (pair_rows: every weight
// row meets them; done per weight row, the permutes and the pair's scale vector had been 5 of a pair's ~19 ops),
// and the two halves' products add in int16 before one vpmaddwd (|pair sum| <= 2 * 15 * 127, two of them
// <= 7620: no saturation). Lanes 0..3 of the result sum block b's products, lanes 4..7 block b + 1's.
inline void load_u4_pair(const uint8_t* p, __m256i& lo, __m256i& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // One load: GCC otherwise folds the load into the first vpand and loads the bytes again for the shift, and on a
  // core with two 128-bit load ports a pair's x operands and weights are already three of its ~4.5 cycles.
  __asm__("" : "+x"(v));
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}

inline void load_x_pair(const int8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  lo = _mm256_permute2x128_si256(a, b, 0x20);
  hi = _mm256_permute2x128_si256(a, b, 0x31);
}

// A pair's products summed in int16 (16 lanes of four products each), before any widening.
inline __m256i sums_u4_pair(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(wlo, xlo), _mm256_maddubs_epi16(whi, xhi));
}

// The same for x's pair at xp (64 int8 values in pair order), loaded here.
inline __m256i sums_u4_pair(__m256i wlo, __m256i whi, const int8_t* xp) {
  return sums_u4_pair(wlo, whi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)),
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
}

inline __m256i dot_u4_pair(__m256i wlo, __m256i whi, __m256i xlo, __m256i xhi) {
  return _mm256_madd_epi16(sums_u4_pair(wlo, whi, xlo, xhi), _mm256_set1_epi16(1));
}

inline __m256 pair_scale(float s0, float s1) {  // s0 in lanes 0..3 (block b), s1 in lanes 4..7 (block b + 1)
  return _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
}

// x's pair order (QuantizedRows::qp, sp) for its M rows; an odd last block is copied as it is.
void pair_rows(QuantizedRows& x, int64_t M) {
  static thread_local std::vector<int8_t> qbuf;
  static thread_local std::vector<float> sbuf;
  const int64_t K = x.K, B = x.B, P = B / 2;
  int8_t* qp = scratch(qbuf, M * K);
  float* sp = scratch(sbuf, std::max<int64_t>(1, M * P * 8));
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* q = x.q + m * K;
    const float* sc = x.scale + m * B;
    int8_t* o = qp + m * K;
    for (int64_t p = 0; p < P; ++p) {
      __m256i lo, hi;
      load_x_pair(q + p * 64, lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 64), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 64 + 32), hi);
      _mm256_storeu_ps(sp + (m * P + p) * 8, pair_scale(sc[2 * p], sc[2 * p + 1]));
    }
    if (B % 2) std::memcpy(o + (B - 1) * 32, q + (B - 1) * 32, 32);
  }
  x.qp = qp;
  x.sp = sp;
}

// x's M rows in the order of int4's interleaved rows (quant/int4.py: pack_int4_interleaved; groups of 64, K % 256
// == 0), into QuantizedRows::qp as pair_rows puts the pair order: per 256 channels (four groups) four 64-byte
// steps k, each the x bytes that meet weight vector k's low nibbles, then its high ones. Byte j of a weight vector
// holds group (j / 4) % 4's channel 8 k + 4 (j / 16) + j % 4 (low nibble) and 32 more (high); x is placed alike.
void interleave_rows(QuantizedRows& x, int64_t M) {
  static thread_local std::vector<int8_t> qbuf;
  const int64_t K = x.K;
  int8_t* qp = scratch(qbuf, M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K; c += 256) {
      const int8_t* src = x.q + m * K + c;
      int8_t* dst = qp + m * K + c;
      for (int k = 0; k < 4; ++k)
        for (int h = 0; h < 2; ++h)
          for (int g = 0; g < 4; ++g)
            for (int plane = 0; plane < 2; ++plane)  // 4 bytes of channels from group g, low then high nibbles
              std::memcpy(dst + k * 64 + plane * 32 + h * 16 + g * 4, src + g * 64 + plane * 32 + k * 8 + h * 4, 4);
    }
  x.qp = qp;
  x.sp = nullptr;
}

// `rows` consecutive weight rows' fp16 group scales and zero points (2G each, as [N, 2, G] holds them) -> float
// scales and scaled zeros s * z (exact: an fp16 s times an integer z < 16), for the tiles (which use each
// weight row's for up to 16 activation rows).
inline void widen_scales(const at::Half* src, int64_t rows, int64_t G, float* dst) {
  const int64_t n = rows * 2 * G;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
  for (; j < n; ++j) dst[j] = _cvtsh_ss(src[j].x);
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = dst + r * 2 * G;
    for (int64_t i = 0; i < G; ++i) sr[G + i] *= sr[i];
  }
}

// A weight row's group scales over the pair (b, b + 1): one broadcast when groups span two blocks or more.
inline __m256 pair_weight_scale(const float* s_row, int64_t b, int gshift) {
  return gshift > 0 ? _mm256_broadcast_ss(s_row + (b >> gshift)) : pair_scale(s_row[b], s_row[b + 1]);
}

// ---- a single stream: one activation row ------------------------------------------------------------------
inline __m256i dot_block_i8(__m256i w, __m256i x) {  // 8 int32 lanes summing the 32 products w * x
  // vpmaddubsw wants one unsigned operand: |w| x (x with w's sign)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                           _mm256_set1_epi16(1));
}

// Weight row wr against the quantized row (row 0 of x), without any weight scale or zero point: the sum over
// blocks b of x's block scale * ws(b) * (integer dot of block b). Blocks go in pairs, one accumulator each, so that
// two FMA chains are in flight. int8: ws(b) = 1 (the caller applies the row's scale).
inline float i8_row(const int8_t* wr, const QuantizedRows& x) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  auto step = [&](int64_t b, int u) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * 32));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * 32));
    acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_block_i8(w, xv)), _mm256_set1_ps(x.scale[b]), acc[u]);
  };
  int64_t b = 0;
  for (; b + 2 <= x.B; b += 2) {
    prefetch_stream<kStreamInt8>(wr + b * 32);
    step(b, 0);
    step(b + 1, 1);
  }
  if (b < x.B) step(b, 0);
  return hsum8(_mm256_add_ps(acc[0], acc[1]));
}

// One activation row (a single stream's decode) against four weight rows n..n+3 at a time: the block of x and its
// scale are loaded once for the four, each row keeps its own accumulator (four FMA chains), and the four dot
// products are reduced together. On the bundled model's 384-wide rows the per-row epilogue (a horizontal sum,
// the zero-point term, the store) cost about as much as a third of the row's blocks; this shares it.
// Only for short rows: there the epilogue matters, and the matrices are small enough to sit in the caches. Streamed
// from memory, four rows read side by side are four streams, which the prefetchers follow worse than one: on the
// Qwen3-0.6B shape's matrices (K 1024..3072, two threads) the four-row pass read int8 at 9-10 GB/s against the
// row-by-row pass's 12-13. (With AVX-512 VNNI every single stream takes the 512-bit rows instead:
// stream_rows_512.)
constexpr int64_t kFourRowsMaxK = 512;

// The horizontal sums of a[0 .. n), n <= 4, as the lanes of one vector (zero past n).
inline __m128 hsums(const __m256* a, int n) {
  const __m256 z = _mm256_setzero_ps();
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], n > 1 ? a[1] : z), _mm256_hadd_ps(n > 2 ? a[2] : z, n > 3 ? a[3] : z));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline void i8_dots_4rows(const int8_t* w, int64_t K, const QuantizedRows& x, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < x.B; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * 32));
    const __m256 xs = _mm256_set1_ps(x.scale[b]);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if ((b & 1) == 0) prefetch_stream<kStreamInt8>(w + i * K + b * 32);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * K + b * 32));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_block_i8(wv, xv)), xs, acc[i]);
    }
  }
  _mm_storeu_ps(out, hsums(acc, 4));
}

// Weight row sr's group scales and zero points ([2G] fp16), groups 8c .. 8c + 7, as float vectors. Lanes past G
// hold the next values in memory (the row's zero points, the next row's scales: finite, and only ever multiplied
// by gsum's zero lanes), except where that would read past `end`, the tensor's end: there they are zero.
inline void scale_chunk(const at::Half* sr, int64_t G, int64_t c, const at::Half* end, __m256& s, __m256& z) {
  const int64_t j = c * 8;
  if (G % 8 == 0 || sr + G + j + 8 <= end) {  // whole chunks (every model's rows) never read past the row
    s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + j)));
    z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sr + G + j)));
  } else {  // the last row's last, partial chunk
    alignas(16) at::Half t[16] = {};
    for (int64_t i = 0; i < G - j; ++i) t[i] = sr[j + i], t[8 + i] = sr[G + j + i];
    s = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
    z = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t + 8)));
  }
}

// One activation row (a single stream's decode) against NR weight rows (K / 2 bytes apart; their fp16 scales
// and zero points 2G apart): out[i] = sum over groups j of s_ij (sum q x - z_ij gsum_j). The scales stay in
// registers, 8 groups per vector, converted as the row reaches them, and each pair of blocks takes its group's
// scale with one lane permute; the zero points' term is a vector FMA per 8 groups, subtracted before the one
// horizontal sum. (Widened into a float buffer per row first, the scales' conversion, the s z products and a
// scalar zero-point loop had cost a 6-group row of the bundled model about a third of its dot products.)
// NR = 4 for short rows (K <= kFourRowsMaxK), as i8_dots_4rows: one accumulator per row; NR = 1 alternates two,
// two FMA chains in flight.

template <int NR>
inline void u4_rows(const uint8_t* w, int64_t K, const at::Half* ss, const at::Half* ss_end, int64_t G, int gshift,
                    const QuantizedRows& x, const float* gsum, float* out) {
  constexpr int U = NR == 1 ? 2 : 1;
  __m256 acc[NR][U], zacc[NR];
  for (int i = 0; i < NR; ++i) {
    zacc[i] = _mm256_setzero_ps();
    for (int u = 0; u < U; ++u) acc[i][u] = _mm256_setzero_ps();
  }
  // the lanes of a pair's scales: one group (g >= 64), or blocks b and b + 1 in groups of their own (g = 32)
  const __m256i pair_lanes = gshift > 0 ? _mm256_setzero_si256() : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t c = 0; c * 8 < G; ++c) {
    __m256 sv[NR];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      __m256 zv;
      scale_chunk(ss + i * 2 * G, G, c, ss_end, sv[i], zv);
      zacc[i] = _mm256_fmadd_ps(_mm256_mul_ps(sv[i], zv), _mm256_loadu_ps(gsum + c * 8), zacc[i]);
    }
    const int64_t b1 = std::min<int64_t>(x.B, (c * 8 + 8) << gshift);
    int64_t b = (c * 8) << gshift;
    // The pair of blocks at b into accumulator u. u is a template argument: indexed at run time (u ^= 1 after
    // each pair, as this had been), the accumulators lived on the stack and every FMA waited on the store and
    // reload of the one before it. In registers: 1.05-1.13x over the 0.6B shape's MLP matrices on a Zen 3, one
    // thread, hot or streamed from memory; 1.07x with two threads (both builds in one process).
    auto pair = [&]<int u>(int64_t b) {
      const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>((b >> gshift) & 7)), pair_lanes);
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qp + b * 32));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qp + b * 32 + 32));
      const __m256 xs = _mm256_loadu_ps(x.sp + b * 4);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        const uint8_t* wr = w + i * (K / 2);
        if ((b & 3) == 0) prefetch_stream<kStreamInt4>(wr + b * 16);  // one 64-byte line per 4 blocks
        __m256i wlo, whi;
        load_u4_pair(wr + b * 16, wlo, whi);
        acc[i][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u4_pair(wlo, whi, xlo, xhi)),
                                    _mm256_mul_ps(xs, _mm256_permutevar8x32_ps(sv[i], idx)), acc[i][u]);
      }
    };
    if constexpr (U == 2)
      for (; b + 4 <= b1; b += 4) {
        pair.template operator()<0>(b);
        pair.template operator()<U - 1>(b + 2);
      }
    for (; b + 2 <= b1; b += 2) pair.template operator()<0>(b);
    if (b < b1) {  // an odd last block (K / 32 odd)
      const __m256i idx = _mm256_set1_epi32(static_cast<int>((b >> gshift) & 7));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qp + b * 32));
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i)
        acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_block_u4(load_u4_block(w + i * (K / 2) + b * 16), xv)),
                                    _mm256_mul_ps(_mm256_set1_ps(x.scale[b]), _mm256_permutevar8x32_ps(sv[i], idx)),
                                    acc[i][0]);
    }
  }
  __m256 r[NR];
  for (int i = 0; i < NR; ++i) r[i] = _mm256_sub_ps(U == 2 ? _mm256_add_ps(acc[i][0], acc[i][U - 1]) : acc[i][0], zacc[i]);
  if constexpr (NR == 1)
    out[0] = hsum8(r[0]);
  else
    _mm_storeu_ps(out, hsums(r, NR));
}

// int6 (quant/int6.py) on AVX2: pair H (0, 1) of a 96-byte quad, its 32 bytes of low nibbles unpacked as
// load_u4_pair's, with the high 2 bits of each weight merged in at bits 4-5 from the quad's plane: pair 0's at
// plane bits 0-1 (lo) and 4-5 (hi), pair 1's at 2-3 and 6-7. Shifts per 16-bit lane, masked to each byte's bits
// 4-5, take them there (within a byte: what crosses from the neighbour is masked off).
template <int H>
inline void load_u6_pair(const uint8_t* quad, __m256i& lo, __m256i& hi) {
  load_u4_pair(quad + 32 * H, lo, hi);
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 64));
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  const __m256i ul = H == 0 ? _mm256_slli_epi16(u, 4) : _mm256_slli_epi16(u, 2);
  const __m256i uh = H == 0 ? u : _mm256_srli_epi16(u, 2);
  lo = _mm256_or_si256(lo, _mm256_and_si256(ul, bits45));
  hi = _mm256_or_si256(hi, _mm256_and_si256(uh, bits45));
}

// The single stream for groups of 64 (u4_rows_g64x4 over rows, u4_row_g64x4 per row, four_g64 per four pairs):
// u4_rows<1> with x quantized per 64 (quantize_q8's span 2; xsg: x's scale per group, G rounded
// up to 8, zero past G), SIX: an int6 row (96 bytes per two pairs, load_u6_pair); PF the prefetch kind, read once
// per call rather than per line. A pair of blocks is then exactly one group and takes one multiplier, s_w s_x. The
// row's multipliers are made first, 8 groups at a time, into `mult` (G rounded up to 8), and read back from
// memory: held in a vector, GCC had picked each lane out with vpermilps + vperm2f128, which a Zen 1 runs as many
// micro-ops (there, where a core splits each 256-bit op in two, this loop is bound by its instructions, not by
// memory). Pairs go four at a time: each pair's two vpmaddubsw sum in int16 (int4: <= 7620 a lane; int6:
// <= 2 * 2 * 63 * 127 = 32004, still no saturation), and the four pairs' sums are reduced into one vector of
// A B C D in each 128-bit lane (pair A's partial dot product in lane 0 of each half, ...), so that one conversion
// and one FMA, against the four multipliers broadcast to both halves by one 128-bit load, finish the four. int4:
// three vphaddw add adjacent int16 lanes (sums of 4 products pairs, then 8: <= 30480), A A B B C C D D in each
// half, then one vpmaddwd; int6's pair sums leave no room to add in int16, so a vpmaddwd per pair, then three
// vphaddd. Per four pairs that is three horizontal adds in place of three conversions, three broadcasts and three
// FMAs (int4: and three vpmaddwd).
// Measured on a Zen 1, two threads. First the multipliers made up front and one pair at a time, against
// u4_rows<1>: whole int4 decodes 1.24x (paired median of 8, same tokens); then four pairs at a time against that:
// the 0.6B shape's int4 body read from memory (112 matrices, alternating in one process, paired median of 12)
// 1.09x, whole int4 decodes 1.09x (paired median of 8).
//
// IL: int4's interleaved rows (pack_int4_interleaved, x in interleave_rows' order): each 32-byte vector of a
// 128-byte step holds 8 bytes of each of the step's four groups, so that a vpmaddubsw's int16 lanes 2i, 2i + 1
// belong to group i % 4 already and the four vectors' sums just add (<= 4 * 7620 = 30480 a lane, no saturation):
// three vpaddw where the pair layout takes three vphaddw, which this core runs at ~3 cycles each (a vpaddw:
// under one). The one vpmaddwd then leaves groups A B C D in each half, as the pair layout's reduction does.
// int6 (pack_int6_interleaved: two of those vectors and their plane of high bits per 96 bytes, as a quad) widens
// each vector's sums with its vpmaddwd, then adds them: three vpaddd for three vphaddd. Measured on this Zen 1
// (alternating in one process, paired medians): the 0.6B shape's int4 body 1.07-1.11x, its int6 head
// (151936 x 1024) 1.05-1.075x at two threads.
//
// The pieces below are functions taking and returning values, not lambdas capturing the row's locals by
// reference: inlined into u4_rows_g64x4, such lambdas had made GCC keep those locals in memory and re-read the
// row's pointers inside the loop over pairs.

// Pair p's int16 sums: 16 lanes, each of two products of each of its two halves. H = p % 2 (int6: which half of
// its quad), a template argument so that its shifts are constants.
template <bool SIX, int H>
[[gnu::always_inline]] inline __m256i pair16_g64(const uint8_t* wr, const int8_t* xqp, int64_t p) {
  __m256i wlo, whi;
  if constexpr (SIX)
    load_u6_pair<H>(wr + (p >> 1) * 96, wlo, whi);
  else
    load_u4_pair(wr + p * 32, wlo, whi);
  return sums_u4_pair(wlo, whi, xqp + p * 64);
}

// Pairs p .. p + 3 (p % 4 == 0; 128 bytes, int6 192) added into acc, as u4_row_g64x4 says.
template <int PF, bool SIX, bool IL>
[[gnu::always_inline]] inline __m256 four_g64(const uint8_t* wr, const int8_t* xqp, const float* mult, int64_t p,
                                              __m256 acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wp = wr + p * (SIX ? 48 : 32);
  prefetch_as<PF>(wp);
  prefetch_as<PF>(wp + 64);
  if constexpr (SIX) prefetch_as<PF>(wp + 128);
  const __m256i a = pair16_g64<SIX, 0>(wr, xqp, p), b = pair16_g64<SIX, 1>(wr, xqp, p + 1);
  const __m256i c = pair16_g64<SIX, 0>(wr, xqp, p + 2), d = pair16_g64<SIX, 1>(wr, xqp, p + 3);
  __m256i h;
  if constexpr (IL && SIX)  // int6: the pairs' sums leave no room in int16, so each widens, then they add
    h = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)),
                         _mm256_add_epi32(_mm256_madd_epi16(c, ones), _mm256_madd_epi16(d, ones)));
  else if constexpr (IL)
    h = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(a, b), _mm256_add_epi16(c, d)), ones);
  else if constexpr (SIX)
    h = _mm256_hadd_epi32(_mm256_hadd_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)),
                          _mm256_hadd_epi32(_mm256_madd_epi16(c, ones), _mm256_madd_epi16(d, ones)));
  else
    h = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d)), ones);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_broadcast_ps(reinterpret_cast<const __m128*>(mult + p)), acc);
}

// A row's multipliers s_w s_x per group into mult (G rounded up to 8) and its zero points' term, the sum over
// groups of s_w z gsum, as eight partial sums to subtract before the horizontal sum.
[[gnu::always_inline]] inline __m256 row_multipliers(const at::Half* sr, const at::Half* end, int64_t G,
                                                     const float* xsg, const float* gsum, float* mult) {
  __m256 zacc = _mm256_setzero_ps();
  for (int64_t c = 0; c * 8 < G; ++c) {
    __m256 sv, zv;
    scale_chunk(sr, G, c, end, sv, zv);
    zacc = _mm256_fmadd_ps(_mm256_mul_ps(sv, zv), _mm256_loadu_ps(gsum + c * 8), zacc);
    _mm256_storeu_ps(mult + c * 8, _mm256_mul_ps(sv, _mm256_loadu_ps(xsg + c * 8)));
  }
  return zacc;
}

// A row's sum over groups j of mult[j] times its integer dot product with x's group j, as eight partial sums.
template <int PF, bool SIX, bool IL>
[[gnu::always_inline]] inline __m256 u4_row_g64x4(const uint8_t* wr, int64_t G, const int8_t* xqp,
                                                  const float* mult) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= G; p += 8) {
    acc0 = four_g64<PF, SIX, IL>(wr, xqp, mult, p, acc0);
    acc1 = four_g64<PF, SIX, IL>(wr, xqp, mult, p + 4, acc1);
  }
  if (p + 4 <= G) {
    acc0 = four_g64<PF, SIX, IL>(wr, xqp, mult, p, acc0);
    p += 4;
  }
  for (; p < G; ++p) {  // G not a multiple of 4: the last pairs one at a time (a pair's 8 lanes sum its product)
    prefetch_as<PF>(wr + p * (SIX ? 48 : 32));
    const __m256i d = p & 1 ? pair16_g64<SIX, 1>(wr, xqp, p) : pair16_g64<SIX, 0>(wr, xqp, p);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d, _mm256_set1_epi16(1))), _mm256_set1_ps(mult[p]),
                           acc1);
  }
  return _mm256_add_ps(acc0, acc1);
}

// Rows n0 .. n1 (rb bytes per weight row; 2G fp16 scales and zero points per row, end: the scales' end):
// y[n] = the row's dot product with x + bias[n]. Eight rows at a time: their multipliers first (into mult,
// [8][G rounded up to 8]), then their dot products, whose partial sums are reduced together (two hsums) and stored
// as eight outputs. A function of its own, every pointer an argument and the rows inlined into it: before, with
// u4_row_g64x4 a call per row, a 1,024-wide int4 row paid a call, a vzeroupper and a horizontal sum of its own
// (1-thread hot harness: ~132 -> ~117 tsc a row of 4,096 x 1,024).
// Measured on this Zen 1 (the 0.6B shape's 28 layers of int4 body and its int6 head, read from
// memory, old and new kernels alternating in one process, paired medians of 10-18): two threads, body 1.02-1.05x,
// head 1.03-1.08x; one thread body 1.06x, head 1.09x.
template <int PF, bool SIX, bool IL, typename T>
[[gnu::noinline]] void u4_rows_g64x4(const uint8_t* w, int64_t rb, const at::Half* ss, const at::Half* end,
                                     int64_t G, const int8_t* xqp, const float* xsg, const float* gsum, float* mult,
                                     const float* bias, T* y, int64_t n0, int64_t n1) {
  const int64_t G8 = (G + 7) / 8 * 8;  // mult: [8][G8], the eight rows' multipliers
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    __m256 z[8], v[8];
    for (int i = 0; i < 8; ++i) z[i] = row_multipliers(ss + (n + i) * 2 * G, end, G, xsg, gsum, mult + i * G8);
    for (int i = 0; i < 8; ++i)
      v[i] = _mm256_sub_ps(u4_row_g64x4<PF, SIX, IL>(w + (n + i) * rb, G, xqp, mult + i * G8), z[i]);
    __m256 s = _mm256_set_m128(hsums(v + 4, 4), hsums(v, 4));
    if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + n));
    alignas(32) float out[8];
    _mm256_store_ps(out, s);
    for (int i = 0; i < 8; ++i) y[n + i] = static_cast<T>(out[i]);
  }
  for (; n < n1; ++n) {
    const __m256 z = row_multipliers(ss + n * 2 * G, end, G, xsg, gsum, mult);
    y[n] = static_cast<T>(hsum8(_mm256_sub_ps(u4_row_g64x4<PF, SIX, IL>(w + n * rb, G, xqp, mult), z)) +
                          (bias ? bias[n] : 0.f));
  }
}

#if LEVERLAB_QUANT_AVX512
// ---- a single stream on AVX-512 VNNI: four blocks per step ------------------------------------------------
// Four consecutive blocks are 64 packed bytes, one 512-bit load: a mask gives weights 0..15 of each block (one
// 128-bit lane per block), a shift and a mask weights 16..31. x is put in the same "quad" order once per call
// (quad_row: per quad, 128 bytes, the four blocks' elements 0..15, then their 16..31), and two vpdpbusd (u8 x s8,
// four products summed into each int32 lane: at most 4 * 15 * 127, no overflow) leave each block's dot product
// in four lanes; its scale, x's block scale times the row's group scale, is one vector per quad (x.sp holds x's,
// the group scales sit 16 to a register and are picked by one vpermps). Against the 256-bit pairs above: ~12
// ops per 128 weights where those take ~28.
// quad_row sets x.q4 and x.sp (block b's scale in lanes 4b .. 4b + 3, as pair_rows lays it out) for one row.
void quad_row(QuantizedRows& x) {
  static thread_local std::vector<int8_t> buf;
  static thread_local std::vector<float> sbuf;
  const int64_t Q = x.B / 4;
  int8_t* o = scratch(buf, std::max<int64_t>(1, Q * 128));
  float* sp = scratch(sbuf, std::max<int64_t>(1, Q * 16));
  for (int64_t q = 0; q < Q; ++q)
    for (int j = 0; j < 4; ++j) {
      std::memcpy(o + q * 128 + j * 16, x.q + (4 * q + j) * 32, 16);
      std::memcpy(o + q * 128 + 64 + j * 16, x.q + (4 * q + j) * 32 + 16, 16);
      std::fill(sp + (4 * q + j) * 4, sp + (4 * q + j) * 4 + 4, x.scale[4 * q + j]);
    }
  x.q4 = o;
  x.sp = sp;
}

// Row sr's scales and zero points ([2G] fp16), groups 16c .. 16c + 15, as scale_chunk does for 8.
inline void scale_chunk16(const at::Half* sr, int64_t G, int64_t c, const at::Half* end, __m512& s, __m512& z) {
  const int64_t j = c * 16;
  if (sr + G + j + 16 <= end) {
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + j)));
    z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + G + j)));
  } else {
    alignas(32) at::Half t[32] = {};
    for (int64_t i = 0; i < std::min<int64_t>(16, G - j); ++i) t[i] = sr[j + i], t[16 + i] = sr[G + j + i];
    s = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t)));
    z = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t + 16)));
  }
}

// int6 (quant/int6.py): a weight is 6 bits, q in 0..63; a row is 96 bytes per quad: its low 4 bits in int4's
// layout (64 bytes), then a plane of their high 2 bits (32 bytes). One stream: with the plane at the row's end
// instead (two runs per row), the hardware prefetcher alone read the 0.6B shape's head at half the rate. Byte t
// of a quad's plane holds the high bits of the quad's lanes t and 32 + t of the low-nibble vector (bits 0-1,
// 2-3) and of the high-nibble vector (bits 4-5, 6-7): the plane, loaded once and broadcast to both 256-bit
// halves, gives every lane's two bits at bits 4-5 of its byte by one vpmultishiftqb per vector (AVX-512 VBMI;
// else a variable shift per 16-bit lane), and one vpternlog merges them in. vpdpbusd's products stay small:
// 4 * 63 * 127 per lane.
__attribute__((always_inline)) inline void add_high2(const uint8_t* plane, __m512i& lo, __m512i& hi) {
  const __m512i u = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)));
  const __m512i bits45 = _mm512_set1_epi8(0x30);
#if defined(__AVX512VBMI__)
  // vpmultishiftqb: output byte r of each qword takes the 8 bits of its qword from bit 8r + f - 4 (rotating), f
  // the field's offset in its byte (0 / 2 for the low vector's lanes 0..31 / 32..63, 4 / 6 for the high one's), so
  // that the field lands at bits 4-5.
  constexpr auto qword = [](int f) {  // the control bytes of one qword for field offset f
    uint64_t c = 0;
    for (int r = 0; r < 8; ++r) c |= static_cast<uint64_t>((8 * r + f - 4) & 63) << (8 * r);
    return static_cast<long long>(c);
  };
  const __m512i lo_ctrl = _mm512_set_epi64(qword(2), qword(2), qword(2), qword(2), qword(0), qword(0), qword(0), qword(0));
  const __m512i hi_ctrl = _mm512_set_epi64(qword(6), qword(6), qword(6), qword(6), qword(4), qword(4), qword(4), qword(4));
  lo = _mm512_ternarylogic_epi32(lo, _mm512_multishift_epi64_epi8(lo_ctrl, u), bits45, 0xF8);  // a | (b & c)
  hi = _mm512_ternarylogic_epi32(hi, _mm512_multishift_epi64_epi8(hi_ctrl, u), bits45, 0xF8);
#else
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // lanes 0..31, 32..63
  const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(u, left), bits45));
  hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi16(u, right), bits45));
#endif
}

// Quad q of a weight row (blocks 4q .. 4q + 3), prefetched ahead and unpacked: lo holds each block's weights
// 0..15 (one 128-bit lane per block), hi its weights 16..31, as x's quad order has them. SIX: an int6 row (96
// bytes a quad), else int4 (64).
template <bool SIX>
__attribute__((always_inline)) inline void u4_quad_unpack(const uint8_t* wr, int64_t q, __m512i& lo, __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const uint8_t* wq = wr + q * (SIX ? 96 : 64);
  if constexpr (SIX) {  // a quad is a line and a half: two prefetches
    prefetch_stream<kStreamInt6>(wq);
    prefetch_stream<kStreamInt6>(wq + 64);
  } else {
    prefetch_stream<kStreamInt4>(wq);
  }
  const __m512i v = _mm512_loadu_si512(wq);
  lo = _mm512_and_si512(v, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  if constexpr (SIX) add_high2(wq + 64, lo, hi);
}

// Quad q of a weight row against x's quad (xlo, xhi: x.q4 + 128 q, + 64): the integer dot products, block b's in
// lanes 4b .. 4b + 3.
template <bool SIX>
__attribute__((always_inline)) inline __m512i u4_quad_dot(const uint8_t* wr, int64_t q, __m512i xlo, __m512i xhi) {
  __m512i lo, hi;
  u4_quad_unpack<SIX>(wr, q, lo, hi);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
}

// u4_rows<1> with quads, for groups of GS blocks (g = 32 GS). The scales of 16 groups sit in one register (sv),
// converted as the row reaches them, and a quad's are picked from it by one vpermps. A whole chunk of 16 groups
// (4 GS quads) is unrolled, so that the permutation is a constant per quad: computing it per quad (the lanes'
// block numbers, shifted by the group size) had been 3 of ~13 ops, and the unrolled chunk ran 1.5-1.7x as many
// weights per second hot in L2 (standalone harness, K = 1024 and 3072). A partial last chunk (G not a
// multiple of 16) takes the same quads with the permutation computed; blocks past the last whole quad (K / 32
// not a multiple of 4) are summed in scalar code. gsum: G rounded up to 16, zero past G. SIX: an int6 row (whole
// quads only: the caller checked K % 128 == 0).
// PER_GROUP: x quantized per 64 (x.sg: one scale per group of 64), so that a group's two scales multiply once per
// chunk of 16 groups, not once per quad: a multiply and a load fewer in each quad's ~12 ops. The 0.6B shape's int4
// body read from memory (112 matrices, two threads, alternating in one process, median of 12): 11.25 -> 10.90 ms,
// its int6 head 4.64 -> 4.48. (Two weight rows per pass, sharing x's loads, had been 1.3-1.6x slower there.)
template <int GS, bool SIX, bool PER_GROUP>
__attribute__((always_inline)) inline __m512 u4_row_512(const uint8_t* wr, const at::Half* sr, const at::Half* end,
                                                        int64_t G, const QuantizedRows& x, const float* gsum) {
  static_assert(!PER_GROUP || GS == 2, "x's scales per group: groups of 64");
  constexpr int kQuadsPerChunk = 4 * GS;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
  const int64_t Q = x.B / 4;
  for (int64_t c = 0; c * 16 < G; ++c) {
    __m512 sv, zv;
    scale_chunk16(sr, G, c, end, sv, zv);
    zacc = _mm512_fmadd_ps(_mm512_mul_ps(sv, zv), _mm512_loadu_ps(gsum + c * 16), zacc);
    if constexpr (PER_GROUP) sv = _mm512_mul_ps(sv, _mm512_loadu_ps(x.sg + c * 16));  // both scales, per group
    // quad q into acc, its lanes' multipliers picked from sv by `lanes`, then (unless PER_GROUP) times x's
    auto quad = [&](int64_t q, __m512i lanes, __m512& acc) {
      __m512 scale = _mm512_permutexvar_ps(lanes, sv);
      if constexpr (!PER_GROUP) scale = _mm512_mul_ps(_mm512_loadu_ps(x.sp + q * 16), scale);
      const __m512i d = u4_quad_dot<SIX>(wr, q, _mm512_loadu_si512(x.q4 + q * 128), _mm512_loadu_si512(x.q4 + q * 128 + 64));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc);
    };
    const int64_t q0 = c * kQuadsPerChunk;
    if (q0 + kQuadsPerChunk <= Q) {
#pragma GCC unroll 32
      for (int j = 0; j < kQuadsPerChunk; ++j) {
        // lanes 4b .. 4b + 3 hold block 4j + b of the chunk, of group (4j + b) / GS
        const __m512i lane_group = _mm512_setr_epi32(
            (4 * j) / GS, (4 * j) / GS, (4 * j) / GS, (4 * j) / GS, (4 * j + 1) / GS, (4 * j + 1) / GS,
            (4 * j + 1) / GS, (4 * j + 1) / GS, (4 * j + 2) / GS, (4 * j + 2) / GS, (4 * j + 2) / GS,
            (4 * j + 2) / GS, (4 * j + 3) / GS, (4 * j + 3) / GS, (4 * j + 3) / GS, (4 * j + 3) / GS);
        quad(q0 + j, lane_group, j & 1 ? acc1 : acc0);
      }
    } else {
      const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      for (int64_t q = q0; q < Q; ++q) {
        const __m512i blk = _mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int>(4 * (q - q0))));
        quad(q, _mm512_srli_epi32(blk, __builtin_ctz(GS)), acc0);
      }
    }
  }
  float tail = 0.f;  // blocks 4Q .. B (K / 32 not a multiple of 4), x in its natural order
  for (int64_t b = 4 * Q; !SIX && b < x.B; ++b) {
    const float ws = static_cast<float>(sr[b / GS]) * x.scale[b];
    const int8_t* xb = x.q + b * 32;
    int32_t dot = 0;
    for (int i = 0; i < 16; ++i)
      dot += static_cast<int32_t>(wr[b * 16 + i] & 15) * xb[i] + static_cast<int32_t>(wr[b * 16 + i] >> 4) * xb[16 + i];
    tail += ws * static_cast<float>(dot);
  }
  const __m512 acc = _mm512_sub_ps(_mm512_add_ps(acc0, acc1), zacc);
  return _mm512_mask_add_ps(acc, 1, acc, _mm512_set1_ps(tail));  // its lanes' sum is the row's dot product
}

// int8's single stream, two blocks (64 weights) per step: x stays in its natural order (block b's 32 bytes fill
// int32 lanes 0..7 of vpdpbusd's result, block b + 1's lanes 8..15), vpdpbusd wants one unsigned operand, so
// |w| x (x with w's sign: AVX-512 has no vpsignb, a masked subtraction does it), and one FMA per pair applies x's
// two block scales (sp2: 8 lanes each, made once per call). ~8 ops per 64 weights where i8_row takes ~16.
void pair_scales16(const QuantizedRows& x, std::vector<float>& buf, int64_t M = 1) {  // row m's at m P 16
  const int64_t P = x.B / 2;
  buf.resize(std::max<int64_t>(1, M * P * 16));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < P; ++p)
      for (int i = 0; i < 16; ++i) buf[(m * P + p) * 16 + i] = x.scale[m * x.B + 2 * p + i / 8];
}

// One pair (blocks b, b + 1) into acc.
inline void i8_pair_512(const int8_t* wr, const QuantizedRows& x, const float* sp2, int64_t b, __m512& acc) {
  const __m512i zero = _mm512_setzero_si512();
  prefetch_stream<kStreamInt8>(wr + b * 32);
  const __m512i w = _mm512_loadu_si512(wr + b * 32), xv = _mm512_loadu_si512(x.q + b * 32);
  const __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w), zero, xv);
  const __m512i d = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w), xs);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(sp2 + b * 8), acc);
}

// Two accumulators, named: indexed by a run-time toggle (acc[u], u ^= 1) gcc kept them on the stack and each FMA
// waited on the previous one's store and reload (perf annotate on a Zen 5: 13% of the kernel's samples on that
// store). One thread, in one process against it (a Zen 5): 28 -> 60-70 G weights/s hot in the caches,
// and the 0.6B shape's int8 head read from memory at 26 -> 31-33 GB/s (the machine reads ~40 with one thread).
__attribute__((always_inline)) inline __m512 i8_row_512(const int8_t* wr, const QuantizedRows& x, const float* sp2) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= x.B; b += 4) {
    i8_pair_512(wr, x, sp2, b, acc0);
    i8_pair_512(wr, x, sp2, b + 2, acc1);
  }
  if (b + 2 <= x.B) {
    i8_pair_512(wr, x, sp2, b, acc0);
    b += 2;
  }
  float tail = 0.f;
  if (b < x.B) {  // an odd last block
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * 32));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * 32));
    tail = static_cast<float>(hsum8_epi32(dot_block_i8(w, xv))) * x.scale[b];
  }
  const __m512 acc = _mm512_add_ps(acc0, acc1);
  return _mm512_mask_add_ps(acc, 1, acc, _mm512_set1_ps(tail));
}

// The single streams' rows on AVX-512 return their accumulator vectors unreduced, and 16 of them are reduced
// together (hsum16, vec_math.h). On the 0.6B shape a row is 8 (int4, K = 1024) to 48 steps long, and perf annotate
// (a Zen 5) had put a third of int4's single-stream samples on one row's reduction and call; timed, int4's 0.6B
// matrices measured the same with it (0.97-1.00x), the bundled model's short rows 1.10x (they had taken a four-row
// pass).
//
// Weight rows n0 .. n1 of a single stream, 16 at a time: y[n] = sum(row(n)) * scale[n] (scale may be null) + bias[n].
template <typename T, typename Row>
inline void stream_rows_512(int64_t n0, int64_t n1, Row row, const float* scale, const float* bias, T* y) {
  for (int64_t n = n0; n < n1; n += 16) {
    const int r = static_cast<int>(std::min<int64_t>(16, n1 - n));
    const __mmask16 live = static_cast<__mmask16>((1u << r) - 1);
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = i < r ? row(n + i) : _mm512_setzero_ps();
    __m512 v = hsum16(a);
    if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(live, scale + n));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + n));
    alignas(64) float out[16];
    _mm512_store_ps(out, v);
    for (int i = 0; i < r; ++i) y[n + i] = static_cast<T>(out[i]);
  }
}
#endif

// ---- several activation rows: tiles of NW weight rows x MG activation rows ---------------------------------
// A tile loads each weight block once for its MG activation rows and each activation block once for its NW
// weight rows, keeps one float accumulator per (weight row, activation row), and reduces them together at the
// end into vectors, so the epilogue (scales, zero points, bias, rounding) also runs 4 outputs at a time. The
// row-at-a-time pass it replaces (the single stream's, run per group of 4 activation rows) paid per 32-weight
// block and activation row for the weight's unpack, a scalar scale product and a broadcast, and per output for a
// horizontal sum and c10's branchy rounding: in one process against it (CPU time, the bundled model's shapes), a
// tile pass is 1.2-1.4x faster for int8 at 2..16 rows, and for int4 1.3-1.8x, 1.6-2.0x with its blocks in pairs.
// At one row the tiles measured 6-10% slower than the single-stream code above, which therefore stays.


// The tile's sums as vectors: out[i] holds weight row i's, lane m for activation row m.
template <int NW, int MG>
inline void reduce_tile(__m256 (&acc)[NW][MG], __m128* out) {
  static_assert(MG <= 4, "a tile takes at most 4 activation rows");
  for (int i = 0; i < NW; ++i) out[i] = hsums(acc[i], MG);
}

// Lanes 0 .. n of v to y[0], y[ld], .. y[(n - 1) ld], rounded to T as static_cast<T> would: bf16 rounds to
// nearest even in integer lanes (c10's rule, NaN to 0x7FC0), without c10's per-value branch, which had been a
// tenth of a 16-row call.
template <typename T>
inline void store_lanes(__m128 v, int n, T* y, int64_t ld) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m128i u = _mm_castps_si128(v);
    const __m128i bias = _mm_add_epi32(_mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1)), _mm_set1_epi32(0x7FFF));
    __m128i r = _mm_srli_epi32(_mm_add_epi32(u, bias), 16);
    r = _mm_blendv_epi8(r, _mm_set1_epi32(0x7FC0), _mm_castps_si128(_mm_cmpunord_ps(v, v)));
    alignas(16) uint32_t t[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), r);
    for (int m = 0; m < n; ++m) y[m * ld].x = static_cast<uint16_t>(t[m]);
  } else {
    alignas(16) float t[4];
    _mm_store_ps(t, v);
    for (int m = 0; m < n; ++m) y[m * ld] = static_cast<T>(t[m]);
  }
}

template <int NW, int MG>
inline void zero_tile(__m256 (&acc)[NW][MG]) {
  for (int i = 0; i < NW; ++i)
    for (int m = 0; m < MG; ++m) acc[i][m] = _mm256_setzero_ps();
}

// A tile's activation rows r0 .. r0 + MG: their int8 values and block scales, the pointers hoisted (read
// through x, gcc reloaded and re-multiplied them per block).
template <int MG>
struct TileRows {
  const int8_t* q[MG];
  const float* scale[MG];
  const int8_t* qp[MG];  // int4's pair order, when x has it
  const float* sp[MG];
  TileRows(const QuantizedRows& x, int64_t r0) {
    for (int m = 0; m < MG; ++m) {
      q[m] = x.q + (r0 + m) * x.K, scale[m] = x.scale + (r0 + m) * x.B;
      qp[m] = x.qp ? x.qp + (r0 + m) * x.K : nullptr, sp[m] = x.sp ? x.sp + (r0 + m) * (x.B / 2) * 8 : nullptr;
    }
  }
};

// int8 weight rows w, w + K, ... (no weight scale: the caller applies the row's) against quantized rows r0 ..
// r0 + MG. vpmaddubsw wants one unsigned operand: |w| x (x with w's sign).
template <int NW, int MG>
inline void i8_tile(const int8_t* w, int64_t K, const QuantizedRows& x, int64_t r0, __m128* out) {
  __m256 acc[NW][MG];
  zero_tile(acc);
  const TileRows<MG> rows(x, r0);
  const auto& xq = rows.q;
  const auto& xsc = rows.scale;
  for (int64_t b = 0; b < x.B; ++b) {
    __m256i wv[NW], wa[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      if ((b & 1) == 0) prefetch_stream<kStreamInt8>(w + i * K + b * 32);
      wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * K + b * 32));
      wa[i] = _mm256_sign_epi8(wv[i], wv[i]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 32));
      const __m256 xs = _mm256_broadcast_ss(xsc[m] + b);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) {
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[i], _mm256_sign_epi8(xv, wv[i])),
                                            _mm256_set1_epi16(1));
        acc[i][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xs, acc[i][m]);
      }
    }
  }
  reduce_tile<NW, MG>(acc, out);
}

// int4 weight rows (K / 2 bytes apart; group scales s, G per row) against quantized rows r0 .. r0 + MG, without
// the zero point (the caller subtracts it): block b's scale is x's block scale times the row's group scale, the
// two multiplied per pair of blocks (load_u4_pair) so that each (weight row, activation row) keeps one accumulator.
template <int NW, int MG>
inline void u4_tile(const uint8_t* w, int64_t K, const float* s, int64_t ss, int gshift, const QuantizedRows& x,
                    int64_t r0, __m128* out) {
  __m256 acc[NW][MG];
  zero_tile(acc);
  const TileRows<MG> rows(x, r0);
  const auto& xq = rows.qp;  // pair order
  const auto& xsc = rows.scale;
  int64_t b = 0;
  for (; b + 2 <= x.B; b += 2) {
    __m256i wlo[NW], whi[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      if ((b & 3) == 0) prefetch_stream<kStreamInt4>(w + i * (K / 2) + b * 16);  // one line per 4 blocks
      load_u4_pair(w + i * (K / 2) + b * 16, wlo[i], whi[i]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m) {
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 32));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 32 + 32));
      const __m256 xs = _mm256_loadu_ps(rows.sp[m] + b * 4);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i)
        acc[i][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u4_pair(wlo[i], whi[i], xlo, xhi)),
                                    _mm256_mul_ps(xs, pair_weight_scale(s + i * ss, b, gshift)), acc[i][m]);
    }
  }
  if (b < x.B) {  // an odd last block
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      const __m256i wv = load_u4_block(w + i * (K / 2) + b * 16);
      for (int m = 0; m < MG; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * 32));
        acc[i][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_block_u4(wv, xv)),
                                    _mm256_set1_ps(s[i * ss + (b >> gshift)] * xsc[m][b]), acc[i][m]);
      }
    }
  }
  reduce_tile<NW, MG>(acc, out);
}

// u4_tile for groups of 64 (x quantized per 64: a pair of blocks is one group, one multiplier s_w s_x per
// activation row), one weight row against activation rows r0 .. r0 + MG: the single stream's four-pair reduction
// (u4_row_g64x4) per activation row, the weight's unpack shared. Per four pairs and activation row that is eight
// vpmaddubsw, four adds, three vphaddw, one vpmaddwd, one conversion and one FMA, where u4_tile pays per pair a
// vpmaddwd, a conversion, a multiply and an FMA. The pairs go two at a time (four registers of unpacked weights),
// their two sums reduced by the first vphaddw at once, so that the MG rows' partial sums and accumulators fit the
// sixteen registers. mult: the MG rows' multipliers, row m's G at mult + m ld (zero past G up to a multiple of 4),
// made by the caller.
// IL: interleaved rows (u4_row_g64x4 says how): the sums add instead of the vphaddw.
template <int MG, bool IL = false>
inline void u4_tile_g64(const uint8_t* w, int64_t G, const QuantizedRows& x, int64_t r0, const float* mult,
                        int64_t ld, __m128* out) {
  __m256 acc[1][MG];
  zero_tile(acc);
  const TileRows<MG> rows(x, r0);
  const auto& xq = rows.qp;  // pair order
  const __m256i ones = _mm256_set1_epi16(1);
  auto pair16 = [&](const __m256i& wlo, const __m256i& whi, int m, int64_t p) {
    return sums_u4_pair(wlo, whi, xq[m] + p * 64);
  };
  int64_t p = 0;
  for (; p + 4 <= G; p += 4) {
    prefetch_stream<kStreamInt4>(w + p * 32);
    prefetch_stream<kStreamInt4>(w + p * 32 + 64);
    __m256i ab[MG];
    {
      __m256i alo, ahi, blo, bhi;
      load_u4_pair(w + p * 32, alo, ahi);
      load_u4_pair(w + p * 32 + 32, blo, bhi);
#pragma GCC unroll 4
      for (int m = 0; m < MG; ++m) {
        const __m256i a = pair16(alo, ahi, m, p), b = pair16(blo, bhi, m, p + 1);
        ab[m] = IL ? _mm256_add_epi16(a, b) : _mm256_hadd_epi16(a, b);
      }
    }
    __m256i clo, chi, dlo, dhi;
    load_u4_pair(w + p * 32 + 64, clo, chi);
    load_u4_pair(w + p * 32 + 96, dlo, dhi);
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m) {
      const __m256i c = pair16(clo, chi, m, p + 2), d = pair16(dlo, dhi, m, p + 3);
      const __m256i h = IL ? _mm256_madd_epi16(_mm256_add_epi16(ab[m], _mm256_add_epi16(c, d)), ones)
                           : _mm256_madd_epi16(_mm256_hadd_epi16(ab[m], _mm256_hadd_epi16(c, d)), ones);
      acc[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h),
                                  _mm256_broadcast_ps(reinterpret_cast<const __m128*>(mult + m * ld + p)), acc[0][m]);
    }
  }
  for (; p < G; ++p) {  // G not a multiple of 4: the last pairs one at a time
    __m256i wlo, whi;
    load_u4_pair(w + p * 32, wlo, whi);
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m)
      acc[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pair16(wlo, whi, m, p), ones)),
                                  _mm256_set1_ps(mult[m * ld + p]), acc[0][m]);
  }
  reduce_tile<1, MG>(acc, out);
}

#if LEVERLAB_QUANT_AVX512
// x's M rows in quad order (quad_row's layout, B % 4 == 0): row m's quads at q4 + m K, its block scales at
// sp + m 4B (block b's in lanes 4b .. 4b + 3).
void quad_rows(QuantizedRows& x, int64_t M) {
  static thread_local std::vector<int8_t> buf;
  static thread_local std::vector<float> sbuf;
  const int64_t K = x.K, B = x.B;
  int8_t* o = scratch(buf, M * K);
  float* sp = scratch(sbuf, M * 4 * B);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t q = 0; q < B / 4; ++q)
      for (int j = 0; j < 4; ++j) {
        const int8_t* src = x.q + m * K + (4 * q + j) * 32;
        std::memcpy(o + m * K + q * 128 + j * 16, src, 16);
        std::memcpy(o + m * K + q * 128 + 64 + j * 16, src + 16, 16);
        std::fill(sp + m * 4 * B + (4 * q + j) * 4, sp + m * 4 * B + (4 * q + j) * 4 + 4, x.scale[m * B + 4 * q + j]);
      }
  x.q4 = o;
  x.sp = sp;
}

// The sums of a[0 .. 4) as the lanes of one vector.
inline __m128 hsums4_512(const __m512* a) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// u4_tile on AVX-512 VNNI, four blocks per step as the single stream's quads (u4_row_512): each weight quad is
// unpacked once for the tile's MG activation rows, and its per-block group scales (wsb: weight row i's at
// wsb + i B, one float per block) become one vector by a lane permute. Needs x in quad order (quad_rows). SIX:
// int6 rows (3K / 4 bytes apart, 96 bytes a quad).
template <int NW, int MG, bool SIX = false>
inline void u4_tile_512(const uint8_t* w, int64_t K, const float* wsb, const QuantizedRows& x, int64_t r0,
                        __m128* out) {
  const int64_t rb = SIX ? 3 * K / 4 : K / 2;  // bytes per weight row
  __m512 acc[NW][MG];
  for (int i = 0; i < NW; ++i)
    for (int m = 0; m < MG; ++m) acc[i][m] = _mm512_setzero_ps();
  const __m512i lane4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t B = x.B, Q = B / 4;
  for (int64_t q = 0; q < Q; ++q) {
    __m512i lo[NW], hi[NW];
    __m512 ws[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      u4_quad_unpack<SIX>(w + i * rb, q, lo[i], hi[i]);
      ws[i] = _mm512_permutexvar_ps(lane4, _mm512_castps128_ps512(_mm_loadu_ps(wsb + i * B + 4 * q)));
    }
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m) {
      const int8_t* xq = x.q4 + (r0 + m) * K + q * 128;
      const __m512i xlo = _mm512_loadu_si512(xq), xhi = _mm512_loadu_si512(xq + 64);
      const __m512 xs = _mm512_loadu_ps(x.sp + (r0 + m) * 4 * B + q * 16);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], xlo), hi[i], xhi);
        acc[i][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(xs, ws[i]), acc[i][m]);
      }
    }
  }
  for (int i = 0; i < NW; ++i) {
    __m512 a[4];
    for (int m = 0; m < 4; ++m) a[m] = m < MG ? acc[i][m] : _mm512_setzero_ps();
    out[i] = hsums4_512(a);
  }
}
#endif

#if LEVERLAB_QUANT_AVX512
// i8_tile on AVX-512 VNNI, two blocks per step as i8_row_512: a weight pair's |w| and sign mask are made once for
// the tile's MG activation rows; per (weight row, activation row) one masked subtraction (x with w's sign), one
// vpdpbusd, a conversion and an FMA with x's two block scales (sp2: row m's at sp2 + m (B / 2) 16). B even.
// Against the 256-bit tile (~5 ops per 32 weights and pair of rows): ~4 per 64. Verification passes (K + 1 rows)
// and small batches run here.
template <int NW, int MG>
inline void i8_tile_512(const int8_t* w, int64_t K, const QuantizedRows& x, const float* sp2, int64_t r0,
                        __m128* out) {
  __m512 acc[NW][MG];
  for (int i = 0; i < NW; ++i)
    for (int m = 0; m < MG; ++m) acc[i][m] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  const int64_t P = x.B / 2;
  for (int64_t p = 0; p < P; ++p) {
    __m512i wa[NW];
    __mmask64 neg[NW];
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      const int8_t* wp = w + i * K + p * 64;
      prefetch_stream<kStreamInt8>(wp);
      const __m512i wv = _mm512_loadu_si512(wp);
      wa[i] = _mm512_abs_epi8(wv);
      neg[i] = _mm512_movepi8_mask(wv);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MG; ++m) {
      const __m512i xv = _mm512_loadu_si512(x.q + (r0 + m) * K + p * 64);
      const __m512 xs = _mm512_loadu_ps(sp2 + ((r0 + m) * P + p) * 16);
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) {
        const __m512i d = _mm512_dpbusd_epi32(zero, wa[i], _mm512_mask_sub_epi8(xv, neg[i], zero, xv));
        acc[i][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xs, acc[i][m]);
      }
    }
  }
  for (int i = 0; i < NW; ++i) {
    __m512 a[4];
    for (int m = 0; m < 4; ++m) a[m] = m < MG ? acc[i][m] : _mm512_setzero_ps();
    out[i] = hsums4_512(a);
  }
}
#endif

// Weight rows n .. n + NW against all M activation rows, in tiles of at most 4 activation rows:
// tile(integral_constant<MG>, m0, out) fills out as reduce_tile does, then emit(i, m0, mg, out[i]) writes weight
// row i's outputs for activation rows m0 .. m0 + mg.
template <int NW, typename Tile, typename Emit>
inline void tile_rows(int64_t M, Tile&& tile, Emit&& emit) {
  __m128 out[NW];
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int mg = static_cast<int>(std::min<int64_t>(4, M - m0));
    auto run = [&](auto c) {
      tile(c, m0, out);
      for (int i = 0; i < NW; ++i) emit(i, m0, mg, out[i]);
    };
    switch (mg) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      default: run(std::integral_constant<int, 4>()); break;
    }
  }
}

// Calls rows(integral_constant<NW>, n) over weight rows [n0, n1): pairs (2 x 4 accumulators), then a last single.
template <typename F>
inline void weight_tiles(int64_t n0, int64_t n1, F&& rows) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) rows(std::integral_constant<int, 2>(), n);
  if (n < n1) rows(std::integral_constant<int, 1>(), n);
}
#endif

// ---- int8 ------------------------------------------------------------------------------------------------

#if LEVERLAB_QUANT_AVX2
// Weight-only: the dot products of weight row n with M float32 activation rows (K16 apart, zero-padded to K16),
// M <= 4: two accumulators per row (the two 8-weight halves of a chunk) keep 2M FMA chains in flight.
template <int M, int U>
inline void row_dots_f32(const float* xs, int64_t K16, const int8_t* wr, int64_t K, float* dots) {
  __m256 acc[M][2 * U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < 2 * U; ++u) acc[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
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
void int8_rows_f32(const at::Tensor& x, const int8_t* w, const float* scale, const float* bias, T* y, int64_t N,
                   int64_t K) {
  static thread_local std::vector<float> xbuf;
  const int64_t M = x.size(0), K16 = (K + 15) / 16 * 16;
  float* xs = scratch(xbuf, M * K16);  // the activations in float32, zero past K
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data_ptr<T>() + m * x.stride(0);
    for (int64_t k = 0; k < K16; ++k) xs[m * K16 + k] = k < K ? static_cast<float>(xr[k]) : 0.f;
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float dots[4];
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t g = std::min<int64_t>(4, M - m0);
        const float* xg = xs + m0 * K16;
#if LEVERLAB_QUANT_AVX2
        switch (g) {
          case 1: row_dots_f32<1, 2>(xg, K16, wr, K, dots); break;
          case 2: row_dots_f32<2, 1>(xg, K16, wr, K, dots); break;
          case 3: row_dots_f32<3, 1>(xg, K16, wr, K, dots); break;
          default: row_dots_f32<4, 1>(xg, K16, wr, K, dots); break;
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

#if LEVERLAB_QUANT_AVX2
template <typename T>
void int8_rows_q8(const at::Tensor& x, const int8_t* w, const float* scale, const float* bias, T* y, int64_t N,
                  int64_t K) {
  const QuantizedRows xq = quantize_q8<T>(x);
  const int64_t M = x.size(0);
#if LEVERLAB_QUANT_AVX512
  static thread_local std::vector<float> sp2buf;  // the calling thread's; the workers read it through sp2
  // AVX-512: every single stream, short rows too (its rows reduced 16 together share their epilogue as the four-row
  // AVX2 pass does; on the bundled model's shapes 1.13-1.14x that pass, one thread, a Zen 5).
  const bool wide = M == 1;
  const bool pairs512 = M > 1 && xq.B % 2 == 0;  // the tiles on AVX-512 VNNI (i8_tile_512)
  if (wide || pairs512) pair_scales16(xq, sp2buf, M);
  const float* sp2 = sp2buf.data();
#endif
  parallel_rows(N, [&](int64_t n0, int64_t n1) {
    if (M == 1) {
      int64_t n = n0;
#if LEVERLAB_QUANT_AVX512
      if (wide) {
        stream_rows_512(n0, n1, [&](int64_t r) { return i8_row_512(w + r * K, xq, sp2); }, scale, bias, y);
        return;
      }
#endif
      if (K <= kFourRowsMaxK) {  // short rows: four weight rows at a time
        float out[4];
        for (; n + 4 <= n1; n += 4) {
          i8_dots_4rows(w + n * K, K, xq, out);
          for (int i = 0; i < 4; ++i) y[n + i] = static_cast<T>(out[i] * scale[n + i] + (bias ? bias[n + i] : 0.f));
        }
      }
      for (; n < n1; ++n) {
        y[n] = static_cast<T>(i8_row(w + n * K, xq) * scale[n] + (bias ? bias[n] : 0.f));
      }
      return;
    }
    weight_tiles(n0, n1, [&](auto nw, int64_t n) {
      constexpr int NW = decltype(nw)::value;
      tile_rows<NW>(
          M,
          [&](auto mg, int64_t m0, __m128* out) {
#if LEVERLAB_QUANT_AVX512
            if (pairs512) return i8_tile_512<NW, decltype(mg)::value>(w + n * K, K, xq, sp2, m0, out);
#endif
            i8_tile<NW, decltype(mg)::value>(w + n * K, K, xq, m0, out);
          },
          [&](int i, int64_t m0, int mg, __m128 v) {
            v = _mm_fmadd_ps(v, _mm_set1_ps(scale[n + i]), _mm_set1_ps(bias ? bias[n + i] : 0.f));
            store_lanes<T>(v, mg, y + m0 * N + n + i, N);
          });
    });
  });
}
#endif

// ---- int4 ------------------------------------------------------------------------------------------------

inline float q_dot_f32(const uint8_t* b, const float* x, int64_t n) {  // n weights (a multiple of 32), x float32
  float s = 0.f;
  for (int64_t k = 0; k < n; k += 32)
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < 16; ++i)
      s += static_cast<float>(b[k / 2 + i] & 15) * x[k + i] + static_cast<float>(b[k / 2 + i] >> 4) * x[k + 16 + i];
  return s;
}

// ss: [N, 2, G] fp16, row n's group scales then its zero points.
template <typename T>
void int4_rows_f32(const at::Tensor& x, const uint8_t* w, const at::Half* ss, int64_t g, const float* bias, T* y,
                   int64_t N, int64_t K) {
  static thread_local std::vector<float> xbuf, sbuf;
  const int64_t M = x.size(0), G = K / g;
  float* xs = scratch(xbuf, M * K);
  float* xsum = scratch(sbuf, M * G);
  std::fill(xsum, xsum + M * G, 0.f);
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
      const at::Half* sr = ss + n * 2 * G;
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t j = 0; j < G; ++j)
          acc += static_cast<float>(sr[j]) * (q_dot_f32(wr + j * g / 2, xs + m * K + j * g, g) -
                                              static_cast<float>(sr[G + j]) * xsum[m * G + j]);
        y[m * N + n] = static_cast<T>(acc + (bias ? bias[n] : 0.f));
      }
    }
  });
}

#if LEVERLAB_QUANT_AVX2
// The zero point's term s z sum(x) uses the quantized x's block sums, so the result is exactly that of the
// dequantized weight times the quantized activations. SIX: int6 rows (3K / 4 bytes each; AVX-512 VNNI and
// K % 128 == 0, which int6_linear checked: the single stream and the quad tiles, for every row count).
// il: w holds interleaved rows (pack_int4_interleaved: AVX2 without AVX-512, groups of 64, K % 256 == 0, which
// int4_linear checked), read by the groups-of-64 single stream and tiles.
template <typename T, bool SIX = false>
void int4_rows_q8(const at::Tensor& x, const uint8_t* w, const at::Half* ss, int64_t g, const float* bias, T* y,
                  int64_t N, int64_t K, bool il = false) {
  static thread_local std::vector<float> gbuf, sgbuf, xsbuf;  // xsbuf: AVX2's several rows, groups of 64
  const int64_t M = x.size(0), G = K / g, bpg = g / 32;
  // Groups of 64 or more: x quantized per 64 (one rounding of at most half a step of max|x| / 127 over 64
  // elements instead of 32), so that with groups of 64 the AVX-512 single stream multiplies its scales per group
  QuantizedRows xq = quantize_q8<T>(x, bpg >= 2 ? 2 : 1);
  const int gshift = __builtin_ctzll(bpg);  // the caller checked that bpg is a power of two
  const int64_t rb = SIX ? 3 * K / 4 : K / 2;  // bytes per weight row
  // Per group, the sum of the quantized x: [M][G16] (gsum; G rounded up to 16, zero past G, so that 8 or 16 groups
  // are one vector), and transposed [G][M4] (M rounded up to 4, zero past M) so that a tile's 4 rows are one vector.
  const int64_t M4 = (M + 3) / 4 * 4, G16 = (G + 15) / 16 * 16;
  float* gsum = scratch(gbuf, M * G16 + G * M4);
  float* gsum_t = gsum + M * G16;
  std::fill(gsum, gsum + M * G16 + G * M4, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < G; ++j) {
      float acc = 0.f;
      for (int64_t b = j * bpg; b < (j + 1) * bpg; ++b) acc += xq.scale[m * xq.B + b] * static_cast<float>(xq.sum[m * xq.B + b]);
      gsum[m * G16 + j] = gsum_t[j * M4 + m] = acc;
    }
  // x in the order the kernels below read it: quads (AVX-512, one long row), else pairs
  bool wide = false, quads = false;  // AVX-512: one long row, or several rows, in quad order
#if LEVERLAB_QUANT_AVX512
  wide = M == 1;  // short rows too, as int8's (1.10x the four-row AVX2 pass on the bundled model's shapes)
  quads = (M >= 4 || (SIX && M > 1)) && xq.B % 4 == 0;  // two or three int4 rows: 0.86-0.93x the pairs, some shapes
  if (wide) quad_row(xq);
  if (quads) quad_rows(xq, M);
#endif
  if (M == 1 && bpg == 2) {  // x's scale per group of 64, as u4_row_512 and u4_row_g64x4 read it (zero past G)
    float* sg = scratch(sgbuf, G16);
    for (int64_t j = 0; j < G16; ++j) sg[j] = j < G ? xq.scale[2 * j] : 0.f;
    xq.sg = sg;
  }
  if (il)
    interleave_rows(xq, M);
  else if (!wide && !quads)
    pair_rows(xq, M);
#if !LEVERLAB_QUANT_AVX512
  float* xs64 = nullptr;  // several rows, groups of 64: x's scale per group, [M][G rounded up to 8], zero past G
  if (M > 1 && bpg == 2 && !SIX) {
    const int64_t G8 = (G + 7) / 8 * 8;
    xs64 = scratch(xsbuf, M * G8);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < G8; ++j) xs64[m * G8 + j] = j < G ? xq.scale[m * xq.B + 2 * j] : 0.f;
  }
#endif
  parallel_rows(N, [&](int64_t n0, int64_t n1) {
    if (M == 1) {
      auto emit = [&](int64_t n, float v) { y[n] = static_cast<T>(v + (bias ? bias[n] : 0.f)); };
      int64_t n = n0;
#if LEVERLAB_QUANT_AVX512
      if (wide) {
        auto rows = [&](auto gs) {
          constexpr int GS = decltype(gs)::value;
          stream_rows_512(n0, n1, [&](int64_t r) {
            return u4_row_512<GS, SIX, GS == 2>(w + r * rb, ss + r * 2 * G, ss + N * 2 * G, G, xq, gsum);
          }, static_cast<const float*>(nullptr), bias, y);
        };
        switch (gshift) {  // blocks per group: g = 32, 64, 128, 256
          case 0: rows(std::integral_constant<int, 1>{}); break;
          case 1: rows(std::integral_constant<int, 2>{}); break;
          case 2: rows(std::integral_constant<int, 4>{}); break;
          default: rows(std::integral_constant<int, 8>{}); break;
        }
        return;
      }
#endif
      if (K <= kFourRowsMaxK && !SIX && !il) {  // short rows: four weight rows at a time
        float out[4];
        for (; n + 4 <= n1; n += 4) {
          u4_rows<4>(w + n * (K / 2), K, ss + n * 2 * G, ss + N * 2 * G, G, gshift, xq, gsum, out);
          for (int i = 0; i < 4; ++i) emit(n + i, out[i]);
        }
      }
      if (gshift == 1) {  // groups of 64 (the default): a pair of blocks is a group
        static thread_local std::vector<float> mbuf;
        float* mult = scratch(mbuf, 8 * G16);  // u4_rows_g64x4's eight rows' multipliers
        auto rows = [&](auto pf) {
          constexpr int PF = decltype(pf)::value;
          const at::Half* end = ss + N * 2 * G;
          if (il)
            u4_rows_g64x4<PF, SIX, true>(w, rb, ss, end, G, xq.qp, xq.sg, gsum, mult, bias, y, n, n1);
          else
            u4_rows_g64x4<PF, SIX, false>(w, rb, ss, end, G, xq.qp, xq.sg, gsum, mult, bias, y, n, n1);
        };
        switch (stream_prefetch_mode(SIX ? kStreamInt6 : kStreamInt4)) {
          case kPrefetchNonTemporal: rows(std::integral_constant<int, kPrefetchNonTemporal>{}); break;
          case kPrefetchAhead: rows(std::integral_constant<int, kPrefetchAhead>{}); break;
          case kPrefetchL2: rows(std::integral_constant<int, kPrefetchL2>{}); break;
          default: rows(std::integral_constant<int, kPrefetchOff>{}); break;
        }
        return;
      }
      if constexpr (SIX) return;  // not reached: int6_linear takes this path with groups of 64 only
      for (; n < n1; ++n) {
        float out;
        u4_rows<1>(w + n * (K / 2), K, ss + n * 2 * G, ss + N * 2 * G, G, gshift, xq, gsum, &out);
        emit(n, out);
      }
      return;
    }
    static thread_local std::vector<float> fbuf;
    // a tile's (up to) 2 weight rows' scales and scaled zeros, widened; then (quads) their scales per block
    float* sf = scratch(fbuf, 2 * 2 * G + 2 * xq.B);
    float* wsb = sf + 2 * 2 * G;
    // the zero points' term, s z sum(x) per group, for weight row i's 4 rows at m0 at once
    auto emit = [&](int64_t n, int i, int64_t m0, int mg, __m128 v) {
      __m128 zterm = _mm_setzero_ps();
      const float* sz = sf + i * 2 * G + G;
      for (int64_t j = 0; j < G; ++j) zterm = _mm_fmadd_ps(_mm_set1_ps(sz[j]), _mm_loadu_ps(gsum_t + j * M4 + m0), zterm);
      store_lanes<T>(_mm_add_ps(_mm_sub_ps(v, zterm), _mm_set1_ps(bias ? bias[n + i] : 0.f)), mg, y + m0 * N + n + i, N);
    };
#if !LEVERLAB_QUANT_AVX512  // (AVX-512 machines keep u4_tile for 2-3 rows: this was measured on AVX2 only)
    if constexpr (!SIX) {
      if (gshift == 1) {  // groups of 64 on AVX2: one weight row at a time (u4_tile_g64)
        static thread_local std::vector<float> mbuf;
        const int64_t G8 = (G + 7) / 8 * 8;
        float* mult = scratch(mbuf, 4 * G8);  // [4][G8]: a tile's rows' multipliers s_w s_x
        for (int64_t n = n0; n < n1; ++n) {
          widen_scales(ss + n * 2 * G, 1, G, sf);
          tile_rows<1>(
              M,
              [&](auto mg, int64_t m0, __m128* out) {
                constexpr int MG = decltype(mg)::value;
                for (int m = 0; m < MG; ++m) {
                  const float* xsg = xs64 + (m0 + m) * G8;
                  float* mm = mult + m * G8;
                  int64_t j = 0;
                  for (; j + 8 <= G; j += 8)
                    _mm256_storeu_ps(mm + j, _mm256_mul_ps(_mm256_loadu_ps(sf + j), _mm256_loadu_ps(xsg + j)));
                  for (; j < G8; ++j) mm[j] = j < G ? sf[j] * xsg[j] : 0.f;
                }
                if (il)
                  u4_tile_g64<MG, true>(w + n * rb, G, xq, m0, mult, G8, out);
                else
                  u4_tile_g64<MG>(w + n * rb, G, xq, m0, mult, G8, out);
              },
              [&](int i, int64_t m0, int mg, __m128 v) { emit(n, i, m0, mg, v); });
        }
        return;
      }
    }
#endif
    weight_tiles(n0, n1, [&](auto nw, int64_t n) {
      constexpr int NW = decltype(nw)::value;
      widen_scales(ss + n * 2 * G, NW, G, sf);
      if (quads)
        for (int i = 0; i < NW; ++i)
          for (int64_t b = 0; b < xq.B; ++b) wsb[i * xq.B + b] = sf[i * 2 * G + (b >> gshift)];
      tile_rows<NW>(
          M,
          [&](auto mg, int64_t m0, __m128* out) {
#if LEVERLAB_QUANT_AVX512
            if (quads) return u4_tile_512<NW, decltype(mg)::value, SIX>(w + n * rb, K, wsb, xq, m0, out);
#endif
            if constexpr (SIX) return;  // not reached: `quads` above
            u4_tile<NW, decltype(mg)::value>(w + n * (K / 2), K, sf, 2 * G, gshift, xq, m0, out);
          },
          [&](int i, int64_t m0, int mg, __m128 v) { emit(n, i, m0, mg, v); });
    });
  });
}
#endif

#if LEVERLAB_QUANT_AVX512
// 16 floats to y's dtype, rounded to nearest even as static_cast<T> rounds them (bf16: vcvtneps2bf16).
template <typename T>
inline void store16(T* y, __m512 v) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  if constexpr (std::is_same_v<T, at::Half>) {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), h);
    return;
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  for (int i = 0; i < 16; ++i) y[i] = static_cast<T>(t[i]);
}

// ---- int4 in panels of 16 weight rows (AVX-512 VNNI) -------------------------------------------------------
// quant/int4.py: pack_int4_panels. Rows n .. n + 15 form a panel; per group of g input channels a panel holds
// g / 8 vectors of 64 bytes, then the 16 rows' fp16 scales and their 16 zero points (64 bytes), so one thread's
// share is one sequential stream with its scales in it. In vector j of a group, int32 lane r holds row r's
// channels 8j .. 8j + 3 in its bytes' low nibbles and 8j + 4 .. 8j + 7 in their high ones: one vpdpbusd takes a
// vector's low nibbles against x's four channels broadcast to every lane (one load, no shuffle), so each lane
// sums one row's products and a group ends with 16 rows' dot products in one vector. The scales then apply
// once per group and x-span for all 16 rows (a conversion and an FMA), there is no horizontal sum and no
// per-quad scale permute: ~5 ops per 128 weights where the quads (u4_row_512) take ~12. Why it matters: the
// quads, streamed from memory, took about their time hot plus the memory's, and a standalone pass
// over the 0.6B shape's int4 body (112 matrices, huge pages, 40 rounds alternating) ran hot 1.6x
// the quads' rate and from memory 1.1x with two threads (~90% of a plain read's rate), ~1.25x with one.
//
// Activation rows m0 .. m0 + MG against panel p: out[m] gets the 16 rows' sums (zero points included, no bias).
// XS: channels per x scale (64 with groups of 64 or more, quantize_q8's span 2; else 32). C: accumulator chains
// per activation row, so that a single stream keeps four vpdpbusd in flight.
// The high nibbles are not shifted down: a vector ANDed with 0xF0 holds 16 times each weight, its products go to
// accumulators of their own, divided by 16 (an exact shift) once per span. x's four channels are broadcast straight
// from memory, the row pointers and the sums are locals (int8 pointers may alias anything: through x.q, gcc had
// reloaded the pointer after every store of `out`, and kept `out` in memory), and each group's lines are prefetched
// at its start, the kind tested once. Per 128 weights that is a load, two ANDs, two broadcasts and two vpdpbusd.
// Against the previous loop (a shift per vector, x as one 8-byte load split in general registers, a prefetch and
// its kind's test per vector; a Zen 4, one thread, in one process, the same bits): int4 hot in L2/L3
// 1.34-1.40x (the 0.6B shape's gate_up rows, 295 KB-3.5 MB: 14.7 -> 10.7 us at 1,024 rows), int6 1.17x; whole
// int4 decodes in a slow spell of the machine's memory (where the stream, not the arithmetic, sets the pace)
// 1.03x, paired medians over 10 generations.
//
// SIX: int6 panels (pack_int6_panels): each 64-byte vector of low nibbles is followed by 32 bytes of the weights'
// high 2 bits, byte t holding those of the low-nibble weights at bytes t and 32 + t (bits 0-1, 4-5) and of the
// high-nibble ones (bits 2-3, 6-7); broadcast to both halves, one 32-bit rotate per vector (by lane half) brings
// each byte's field to bits 4-5, and one vpternlog merges it in. Products stay small (4 * 63 * 127 a lane).
// A group's lines are prefetched in the family's measured kind (stream_hint.h: on this project's Zen 4 the
// hardware alone streamed these panels fastest in a standalone pass, while a Xeon's quantized kernels had needed
// T0 ahead; the loader times the kinds per model).

// Vector pv's 128 weights (16 rows x 8 channels): lo holds channels 0-3 of each row's lane, hi16 channels 4-7, for
// int4 as 16 times their values (the high nibbles in place), for int6 as their values.
template <bool SIX>
__attribute__((always_inline)) inline void panel_unpack(const uint8_t* pv, __m512i& lo, __m512i& hi16) {
  const __m512i v = _mm512_loadu_si512(pv);
  lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
  if constexpr (!SIX) {
    hi16 = _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xF0)));
  } else {
    hi16 = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    const __m512i u = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pv + 64)));
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    // right rotations of each dword: 28 (left 4) takes bits 0-1 to 4-5, 0 keeps 4-5, 30 (left 2) takes 2-3, 2 takes 6-7
    const __m512i rot_lo = _mm512_inserti64x4(_mm512_set1_epi32(28), _mm256_set1_epi32(0), 1);
    const __m512i rot_hi = _mm512_inserti64x4(_mm512_set1_epi32(30), _mm256_set1_epi32(2), 1);
    lo = _mm512_ternarylogic_epi32(lo, _mm512_rorv_epi32(u, rot_lo), bits45, 0xF8);  // a | (b & c)
    hi16 = _mm512_ternarylogic_epi32(hi16, _mm512_rorv_epi32(u, rot_hi), bits45, 0xF8);
  }
}

// The non-temporal kind's distance for the panels: 4 KB, about seven int4 groups ahead, where the other kernels
// request 1 KB. Measured on a Zen 4 (the int4 0.6B shape's greedy decodes, 128 tokens after 128, in one
// process with the distance switched per generation, paired medians of 8-10): 1 KB 1.00, 2 KB 1.03, 3 KB 1.04,
// 4 KB 1.05-1.07 (four runs, fast and slow spells of the memory), 6 KB 1.05, 8 KB 1.04, 16 KB 1.02, 32 KB 0.98;
// of 4 KB's 1.05, the int4 body took 1.03 and the int6 head 1.01. T0 4 KB ahead (the t0 kind): 1.01. The bf16 and
// int8 kernels lost with it (0.96 and 0.92 against their measured kinds) and keep 1 KB. (An earlier loop, a
// prefetch per vector, had lost with 2 and 4 KB: 0.87x, 0.89x; requesting a group's lines at once changed that.)
constexpr int64_t kPanelNtaAhead = 4096;

// SYM: zero-point-free int4 panels (pack_int4_panels' symmetric form, 8 g + 32 bytes a group): every zero point is
// 8 and is not stored, so that llama.cpp's Q4_0 (d (q - 8) per 32 weights) streams its own 4.5 bits per weight
// rather than 5 (quant/gguf.py).
template <int MG, int XS, bool SIX, bool SYM = false>
__attribute__((always_inline)) inline void panel_rows(const uint8_t* p, int64_t G, int64_t g, const QuantizedRows& x,
                                                      const float* gsum, int64_t G16, int64_t m0, __m512* out) {
  constexpr int C = MG >= 4 ? 1 : 4 / MG;
  constexpr int LPS = XS / 8;  // vectors per x span
  constexpr int VB = SIX ? 96 : 64;  // bytes per vector of 128 weights
  constexpr int kFamily = SIX ? kStreamInt6 : kStreamInt4;
  const int64_t K = x.K, wb = g / 8 * VB, gb = wb + (SYM ? 32 : 64);  // a group's weight bytes, and with its scales
  const int8_t* const xq = x.q + m0 * K;
  const float* const xscale = x.scale + m0 * x.B;
  __m512 o[MG];
  for (int m = 0; m < MG; ++m) o[m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < G; ++j) {
    const uint8_t* pg = p + j * gb;
    prefetch_lines<kFamily, kPanelNtaAhead>(pg, gb);  // the group's lines, weights and scales
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + wb)));
    const __m512 z = SYM ? _mm512_set1_ps(8.f)
                         : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + wb + 32)));
    for (int64_t c0 = 0; c0 < g; c0 += XS) {  // one x scale each
      __m512i alo[MG][C], ahi[MG][C];
      for (int m = 0; m < MG; ++m)
        for (int c = 0; c < C; ++c) alo[m][c] = ahi[m][c] = _mm512_setzero_si512();
      const uint8_t* pc = pg + (c0 / 8) * VB;
      const int8_t* xc = xq + j * g + c0;
#pragma GCC unroll 8
      for (int l = 0; l < LPS; ++l) {
        __m512i lo, hi;
        panel_unpack<SIX>(pc + l * VB, lo, hi);
#pragma GCC unroll 8
        for (int m = 0; m < MG; ++m) {
          int32_t x0, x1;
          std::memcpy(&x0, xc + m * K + 8 * l, 4);
          std::memcpy(&x1, xc + m * K + 8 * l + 4, 4);
          alo[m][l % C] = _mm512_dpbusd_epi32(alo[m][l % C], lo, _mm512_set1_epi32(x0));
          ahi[m][l % C] = _mm512_dpbusd_epi32(ahi[m][l % C], hi, _mm512_set1_epi32(x1));
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MG; ++m) {
        __m512i a = alo[m][0], b = ahi[m][0];
        for (int c = 1; c < C; ++c) a = _mm512_add_epi32(a, alo[m][c]), b = _mm512_add_epi32(b, ahi[m][c]);
        a = _mm512_add_epi32(a, SIX ? b : _mm512_srai_epi32(b, 4));  // int4: b is 16 times its sum, exactly
        const float xs = xscale[m * x.B + (j * g + c0) / 32];
        o[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(xs)), o[m]);
      }
    }
    const __m512 sz = _mm512_mul_ps(s, z);  // the zero points' term: s z sum(x) per group (gsum: x's sums, scaled)
#pragma GCC unroll 8
    for (int m = 0; m < MG; ++m) o[m] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(gsum[(m0 + m) * G16 + j]), o[m]);
  }
  for (int m = 0; m < MG; ++m) out[m] = o[m];
}

// y [M, N] = x W^T + b for W in panels (N % 16 == 0, g % 32 == 0); activation rows 8 at a time (up to 8 rows keep
// their accumulators in registers; more re-read the panel from L1/L2, not from memory). SIX: int6 panels.
template <typename T, bool SIX = false, bool SYM = false>
void int4_panels_q8(const at::Tensor& x, const uint8_t* w, int64_t g, const float* bias, T* y, int64_t N, int64_t K) {
  static thread_local std::vector<float> gbuf;
  const int64_t M = x.size(0), G = K / g, bpg = g / 32, G16 = (G + 15) / 16 * 16;
  const QuantizedRows xq = quantize_q8<T>(x, bpg >= 2 ? 2 : 1);
  float* gsum = scratch(gbuf, M * G16);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < G; ++j) {
      float acc = 0.f;
      for (int64_t b = j * bpg; b < (j + 1) * bpg; ++b) acc += xq.scale[m * xq.B + b] * static_cast<float>(xq.sum[m * xq.B + b]);
      gsum[m * G16 + j] = acc;
    }
  const int64_t pb = G * (g / 8 * (SIX ? 96 : 64) + (SYM ? 32 : 64));  // bytes per panel
  // Each panel is computed by the range that holds its first row: parallel_rows' chunks are whole panels (multiples
  // of 64 rows), at::parallel_for's (past kMaxThreads threads) need not be.
  parallel_rows(N, [&](int64_t n0, int64_t n1) {
    for (int64_t n = (n0 + 15) / 16 * 16; n < n1; n += 16) {
      const uint8_t* p = w + (n / 16) * pb;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        __m512 out[8];
        const int mg = static_cast<int>(std::min<int64_t>(8, M - m0));
        auto run = [&](auto c) {
          constexpr int MG = decltype(c)::value;
          if (g >= 64) panel_rows<MG, 64, SIX, SYM>(p, G, g, xq, gsum, G16, m0, out);
          else panel_rows<MG, 32, SIX, SYM>(p, G, g, xq, gsum, G16, m0, out);
        };
        switch (mg) {
          case 1: run(std::integral_constant<int, 1>()); break;
          case 2: run(std::integral_constant<int, 2>()); break;
          case 3: run(std::integral_constant<int, 3>()); break;
          case 4: run(std::integral_constant<int, 4>()); break;
          case 5: run(std::integral_constant<int, 5>()); break;
          case 6: run(std::integral_constant<int, 6>()); break;
          case 7: run(std::integral_constant<int, 7>()); break;
          default: run(std::integral_constant<int, 8>()); break;
        }
        const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < mg; ++m) store16(y + (m0 + m) * N + n, _mm512_add_ps(out[m], b));
      }
    }
  });
}
#endif

// Weight k (q in 0..15) into an int4 row of the row layout (pack_int4_streaming: byte i of a 32-weight block holds
// weights i, low nibble, and 16 + i, high), leaving the byte's other nibble as it is.
inline void put_u4(uint8_t* row, int64_t k, uint8_t q) {
  const int64_t i = k % 32;
  uint8_t& o = row[(k / 32) * 16 + i % 16];
  o = i < 16 ? static_cast<uint8_t>((o & 0xF0) | q) : static_cast<uint8_t>((o & 0x0F) | (q << 4));
}

// Weight k (q in 0..63) into a zeroed int6 row of the row layout (pack_int6_streaming: u6_at's positions).
inline void put_u6(uint8_t* row, int64_t k, int q) {
  const int64_t i = k % 32, lane = 16 * ((k % 128) / 32) + i % 16;
  uint8_t* quad = row + (k / 128) * 96;
  quad[((k % 128) / 32) * 16 + i % 16] |= static_cast<uint8_t>(i < 16 ? q & 15 : (q & 15) << 4);
  quad[64 + lane % 32] |= static_cast<uint8_t>((q >> 4) << ((i < 16 ? 0 : 4) + (lane < 32 ? 0 : 2)));
}

// Where interleaved rows (pack_int4_interleaved; quant/int4.py interleaved_lanes) hold channel c of a 256-channel
// step: 32-byte vector v, byte j, nibble 0 (low) or 1 (high). Channel 64 g + 32 nibble + 8 v + 4 h + t sits at
// byte 16 h + 4 g + t.
struct InterleavedAt {
  int64_t v, j, nibble;
};
inline InterleavedAt interleaved_at(int64_t c) {
  const int64_t r = c % 64;
  return {(r % 32) / 8, 16 * ((r % 8) / 4) + 4 * (c / 64) + r % 4, r / 32};
}

// Panels back to the row layout (pack_int4_streaming's [N, K / 2]), for the paths that read rows: float32
// activations (exact), more rows than stream, CPUs without AVX-512 VNNI. Either form: a group is 8 g + 64 bytes,
// or 8 g + 32 without its zero points (SYM above); the row layout's zero points come from the scales tensor.
at::Tensor panels_to_rows(const at::Tensor& panels, int64_t N, int64_t K, int64_t g) {
  const int64_t G = K / g, gb = panels.size(2), pb = G * gb;
  auto rows = at::empty({N, K / 2}, at::kByte);
  const uint8_t* src = panels.data_ptr<uint8_t>();
  uint8_t* dst = rows.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* p = src + (n / 16) * pb;
      const int r = static_cast<int>(n % 16);
      uint8_t* out = dst + n * (K / 2);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = k / g, c = k % g, v = c / 8, t = c % 8;
        const uint8_t byte = p[j * gb + v * 64 + 4 * r + t % 4];
        put_u4(out, k, t < 4 ? byte & 15 : byte >> 4);
      }
    }
  });
  return rows;
}

#if LEVERLAB_QUANT_AVX512
// ---- int8 in panels of 16 weight rows (AVX-512 VNNI) -------------------------------------------------------
// quant/int8.py: pack_int8_panels. Rows n .. n + 15 form a panel; per 32-channel block a panel holds 8 vectors of
// 64 bytes, int32 lane r of vector j holding row r's channels 4j .. 4j + 3, each stored as w + 128 (0..255), so
// that vpdpbusd (unsigned x signed) takes it against x's four channels broadcast: sum (w + 128) x = sum w x +
// 128 sum x, and the block's integer sum of x (quantize_q8) takes the offset back out exactly. Per 64 bytes a
// load and one vpdpbusd, where the row layout's pairs (i8_row_512) take ~9 ops (|w|, x with w's sign, the
// conversion and FMA per pair, x's loads); the block's conversion and FMA serve 16 rows. Same reasons and
// shape as int4's panels (panel_rows above): one stream per thread, no horizontal sums, and each output row's
// value independent of how many activation rows come with it.
template <int MG>
__attribute__((always_inline)) inline void panel_rows_i8(const uint8_t* p, const QuantizedRows& x, int64_t m0,
                                                         __m512* out) {
  constexpr int C = MG >= 4 ? 1 : 4 / MG;
  const int64_t K = x.K;
  for (int m = 0; m < MG; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.B; ++b) {
    const uint8_t* pb = p + b * 512;
    __m512i acc[MG][C];
    for (int m = 0; m < MG; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      prefetch_stream<kStreamInt8>(pb + l * 64);  // the family's measured kind, as panel_rows
      const __m512i v = _mm512_loadu_si512(pb + l * 64);
#pragma GCC unroll 8
      for (int m = 0; m < MG; ++m) {
        int32_t x4;
        std::memcpy(&x4, x.q + (m0 + m) * K + b * 32 + 4 * l, 4);
        acc[m][l % C] = _mm512_dpbusd_epi32(acc[m][l % C], v, _mm512_set1_epi32(x4));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MG; ++m) {
      __m512i a = acc[m][0];
      for (int c = 1; c < C; ++c) a = _mm512_add_epi32(a, acc[m][c]);
      a = _mm512_sub_epi32(a, _mm512_set1_epi32(128 * x.sum[(m0 + m) * x.B + b]));
      out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(x.scale[(m0 + m) * x.B + b]), out[m]);
    }
  }
}

// y [M, N] = x W^T * scale + b for W in panels (N % 16 == 0, K % 32 == 0), activation rows 8 at a time.
template <typename T>
void int8_panels_q8(const at::Tensor& x, const uint8_t* w, const float* scale, const float* bias, T* y, int64_t N,
                    int64_t K) {
  const int64_t M = x.size(0);
  const QuantizedRows xq = quantize_q8<T>(x);
  parallel_rows(N, [&](int64_t n0, int64_t n1) {  // each panel by the range holding its first row (int4_panels_q8)
    for (int64_t n = (n0 + 15) / 16 * 16; n < n1; n += 16) {
      const uint8_t* p = w + n * K;  // a panel is 16 K bytes
      const __m512 s = _mm512_loadu_ps(scale + n);
      const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        __m512 out[8];
        const int mg = static_cast<int>(std::min<int64_t>(8, M - m0));
        switch (mg) {
          case 1: panel_rows_i8<1>(p, xq, m0, out); break;
          case 2: panel_rows_i8<2>(p, xq, m0, out); break;
          case 3: panel_rows_i8<3>(p, xq, m0, out); break;
          case 4: panel_rows_i8<4>(p, xq, m0, out); break;
          case 5: panel_rows_i8<5>(p, xq, m0, out); break;
          case 6: panel_rows_i8<6>(p, xq, m0, out); break;
          case 7: panel_rows_i8<7>(p, xq, m0, out); break;
          default: panel_rows_i8<8>(p, xq, m0, out); break;
        }
        for (int m = 0; m < mg; ++m) store16(y + (m0 + m) * N + n, _mm512_fmadd_ps(out[m], s, b));
      }
    }
  });
}
#endif

// int6 panels (pack_int6_panels) back to int6 rows (pack_int6_streaming's [N, 3K / 4]: u6_at's layout).
at::Tensor int6_panels_to_rows(const at::Tensor& panels, int64_t N, int64_t K, int64_t g) {
  const int64_t G = K / g, gb = g / 8 * 96 + 64, pb = G * gb;
  auto rows = at::zeros({N, 3 * K / 4}, at::kByte);
  const uint8_t* src = panels.data_ptr<uint8_t>();
  uint8_t* dst = rows.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* p = src + (n / 16) * pb;
      const int r = static_cast<int>(n % 16);
      uint8_t* out = dst + n * (3 * K / 4);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = k / g, c = k % g, v = c / 8, t = c % 8;
        const uint8_t* pv = p + j * gb + v * 96;
        const int byte = 4 * r + t % 4;  // in the vector; t < 4: its low nibble, else its high one
        const uint8_t plane = pv[64 + byte % 32];
        const int field = (t < 4 ? 0 : 2) + (byte < 32 ? 0 : 4);
        put_u6(out, k, (t < 4 ? pv[byte] & 15 : pv[byte] >> 4) | (((plane >> field) & 3) << 4));
      }
    }
  });
  return rows;
}

// int6 interleaved rows (pack_int6_interleaved: [N, K / 256, 192]) back to int6 rows, as int6_panels_to_rows.
// Per 256 channels, two 96-byte units: int4's interleaved vectors 2u and 2u + 1 (interleaved_at), then their high
// 2 bits, byte t holding those of vector 2u's low and high nibbles at t in bits 0-1 and 4-5, vector 2u + 1's in
// bits 2-3 and 6-7 (load_u6_pair's order).
at::Tensor int6_interleaved_to_rows(const at::Tensor& il, int64_t N, int64_t K) {
  auto rows = at::zeros({N, 3 * K / 4}, at::kByte);
  const uint8_t* src = il.data_ptr<uint8_t>();
  uint8_t* dst = rows.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint8_t* out = dst + n * (3 * K / 4);
      for (int64_t k = 0; k < K; ++k) {
        const InterleavedAt at = interleaved_at(k % 256);
        const uint8_t* unit = src + (n * (K / 256) + k / 256) * 192 + (at.v / 2) * 96;
        const uint8_t byte = unit[(at.v % 2) * 32 + at.j];
        const int64_t field = 4 * at.nibble + 2 * (at.v % 2);
        put_u6(out, k, (at.nibble == 0 ? byte & 15 : byte >> 4) | (((unit[64 + at.j] >> field) & 3) << 4));
      }
    }
  });
  return rows;
}

// int8 panels back to rows ([N, K] int8), for the paths that read rows (float32 or weight-only activations, more
// rows than stream, CPUs without AVX-512 VNNI).
at::Tensor int8_panels_to_rows(const at::Tensor& panels, int64_t N, int64_t K) {
  auto rows = at::empty({N, K}, at::kChar);
  const uint8_t* src = panels.data_ptr<uint8_t>();
  int8_t* dst = rows.data_ptr<int8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[n * K + k] = static_cast<int8_t>(src[(n / 16) * 16 * K + (k / 32) * 512 + ((k % 32) / 4) * 64 + (n % 16) * 4 + k % 4] ^ 0x80);
  });
  return rows;
}

// The group size and the [N, 2, K / group] fp16 scales and zero points that int4_linear and int6_linear take.
void check_group_scales(const char* op, int64_t N, int64_t K, int64_t group, const at::Tensor& scales) {
  TORCH_CHECK(group % 32 == 0 && K % group == 0, op, ": the group size is a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == N && scales.size(1) == 2 && scales.size(2) == K / group,
              op, ": fp16 scales and zero points [N, 2, K / group]");
}

template <typename T>
constexpr bool kHalfWidth = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

}  // namespace

// x [M, K] (float32 / bf16 / fp16), w [N, K] int8, scale [N] float32, bias [N] or none -> [M, N] in x's dtype.
// Streams for up to quant_max_rows() rows; above that, aten's matmul on the dequantized weight. quantize_x: bf16/fp16
// activations take the integer path (per-32-block int8 activations; needs K % 32 == 0), else the weight-only one.
// w may also be panels [N / 16, K / 32, 512] uint8 (pack_int8_panels): bf16/fp16 rows up to quant_max_rows() with
// quantize_x stream them on AVX-512 VNNI, the rest take the row layout.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool quantize_x) {
  if (w.dim() == 3) {
    TORCH_CHECK(x.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous(), "int8_linear: x [M, K], float32 scale [N]");
    const int64_t M = x.size(0), N = scale.numel(), K = x.size(1);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && N % 16 == 0 && K % 32 == 0 &&
                    w.size(0) == N / 16 && w.size(1) == K / 32 && w.size(2) == 512,
                "int8_linear: panels [N / 16, K / 32, 512] uint8 (pack_int8_panels)");
#if LEVERLAB_QUANT_AVX512
    if (quantize_x && M <= quant_max_rows() && x.stride(1) == 1 &&
        (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)) {
      at::Tensor b32;
      const float* bp = bias_f32(bias, b32);
      auto y = at::empty({M, N}, x.options());
      AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "int8_linear", [&] {
        int8_panels_q8<scalar_t>(x, w.data_ptr<uint8_t>(), scale.data_ptr<float>(), bp, y.data_ptr<scalar_t>(), N, K);
      });
      return y;
    }
#endif
    return int8_linear(x, int8_panels_to_rows(w, N, K), scale, bias, quantize_x);
  }
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_linear: contiguous int8 weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "int8_linear: float32 scale [N]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (M > quant_max_rows() || x.stride(1) != 1) {
    at::Tensor y = at::mm(x, w.t().to(x.scalar_type())) * scale.to(x.scalar_type());
    return bias.has_value() && bias->defined() ? y + *bias : y;
  }
  auto y = at::empty({M, N}, x.options());
  at::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  auto sc = scale.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
#if LEVERLAB_QUANT_AVX2
    if constexpr (kHalfWidth<scalar_t>) {
      if (quantize_x && K % 32 == 0) {
        int8_rows_q8<scalar_t>(x, w.data_ptr<int8_t>(), sc.data_ptr<float>(), bp, y.data_ptr<scalar_t>(), N, K);
        return;
      }
    }
#endif
    int8_rows_f32<scalar_t>(x, w.data_ptr<int8_t>(), sc.data_ptr<float>(), bp, y.data_ptr<scalar_t>(), N, K);
  });
  return y;
}

namespace {

// int4_linear's and int6_linear's panels (SIX: int6's, 12 g + 64 bytes a group, K % 128 == 0; else 8 g + 64):
// the shapes checked, bf16/fp16 rows up to quant_max_rows() streamed on AVX-512 VNNI, anything else handed to
// rows(N, K), which runs the row layout on the unpacked panels.
template <bool SIX, typename Rows>
at::Tensor panel_linear(const char* op, const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                        int64_t group, const c10::optional<at::Tensor>& bias, Rows&& rows) {
  TORCH_CHECK(x.dim() == 2 && scales.dim() == 3, op, ": x [M, K], scales [N, 2, K / g]");
  const int64_t M = x.size(0), N = scales.size(0), K = x.size(1);
  // int4 panels without zero points (8 g + 32 bytes a group): every zero point is 8 (pack_int4_panels' symmetric)
  const bool sym = !SIX && panels.dim() == 3 && panels.size(2) == 8 * group + 32;
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() && group % 32 == 0 && K % group == 0 &&
                  (!SIX || K % 128 == 0) && N % 16 == 0 && panels.size(0) == N / 16 &&
                  panels.size(1) == K / group && (sym || panels.size(2) == (SIX ? 12 : 8) * group + 64),
              op, ": panels [N / 16, K / g, ", SIX ? "12" : "8", " g + 64", SIX ? "" : " (or 8 g + 32, symmetric)",
              "] uint8 (", SIX ? "pack_int6_panels" : "pack_int4_panels", ")");
  check_group_scales(op, N, K, group, scales);
#if LEVERLAB_QUANT_AVX512
  if (M <= quant_max_rows() && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)) {
    at::Tensor b32;
    const float* bp = bias_f32(bias, b32);
    auto y = at::empty({M, N}, x.options());
    AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "panel_linear", [&] {
      if constexpr (SIX) {
        int4_panels_q8<scalar_t, true>(x, panels.data_ptr<uint8_t>(), group, bp, y.data_ptr<scalar_t>(), N, K);
      } else if (sym) {
        int4_panels_q8<scalar_t, false, true>(x, panels.data_ptr<uint8_t>(), group, bp, y.data_ptr<scalar_t>(), N, K);
      } else {
        int4_panels_q8<scalar_t, false>(x, panels.data_ptr<uint8_t>(), group, bp, y.data_ptr<scalar_t>(), N, K);
      }
    });
    return y;
  }
#endif
  return rows(N, K);
}

}  // namespace

// Whether int4_linear streams interleaved rows (pack_int4_interleaved): AVX2 builds without AVX-512 VNNI, whose
// single stream and tiles read them (AVX-512 VNNI streams panels instead).
bool has_int4_interleaved() {
#if LEVERLAB_QUANT_AVX2 && !LEVERLAB_QUANT_AVX512
  return true;
#else
  return false;
#endif
}

// Interleaved rows [N, K / 256, 128] (pack_int4_interleaved) in the row layout [N, K / 2], for the paths that
// read that (float32 activations, more rows than stream, other CPUs). interleaved_at says where each channel is.
at::Tensor interleaved_to_rows(const at::Tensor& il) {
  const int64_t N = il.size(0), S = il.size(1), K = 256 * S;
  auto rows = at::empty({N, K / 2}, at::kByte);
  const uint8_t* src = il.data_ptr<uint8_t>();
  uint8_t* dst = rows.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const InterleavedAt at = interleaved_at(k % 256);
        const uint8_t byte = src[(n * S + k / 256) * 128 + at.v * 32 + at.j];
        put_u4(dst + n * (K / 2), k, at.nibble == 0 ? byte & 15 : byte >> 4);
      }
  });
  return rows;
}

namespace {

// int4_linear's and int6_linear's interleaved rows (SIX: int6's, [N, K / 256, 192]; else [N, K / 256, 128]): the
// shapes checked, bf16/fp16 rows up to quant_max_rows() streamed where has_int4_interleaved(), anything else
// handed to rows(), which runs the row layout on the converted weight.
template <bool SIX, typename Rows>
at::Tensor interleaved_linear(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              int64_t group, const c10::optional<at::Tensor>& bias, Rows&& rows) {
  TORCH_CHECK(x.dim() == 2 && group == 64 && x.size(1) == 256 * packed.size(1) && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              op, ": x [M, K], interleaved rows [N, K / 256, ", SIX ? "192" : "128", "] uint8, groups of 64");
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1);
  const bool streams = has_int4_interleaved() && M <= quant_max_rows() && x.stride(1) == 1 &&
                       (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
  if (!streams) return rows();
  check_group_scales(op, N, K, group, scales);
  at::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  auto y = at::empty({M, N}, x.options());
#if LEVERLAB_QUANT_AVX2
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "interleaved_linear", [&] {
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const at::Half* ss = scales.data_ptr<at::Half>();
    if constexpr (SIX)  // row by row, as the row layout's AVX2 path (the int6 stream takes one row)
      for (int64_t m = 0; m < M; ++m)
        int4_rows_q8<scalar_t, true>(x.narrow(0, m, 1), w, ss, group, bp, y.data_ptr<scalar_t>() + m * N, N, K, true);
    else
      int4_rows_q8<scalar_t>(x, w, ss, group, bp, y.data_ptr<scalar_t>(), N, K, /*il=*/true);
  });
#endif
  return y;
}

}  // namespace

// x [M, K], packed [N, K / 2] uint8 (the layout above), scales [N, 2, K / g] fp16 (row n's group scales, then its
// zero points) -> [M, N] in x's dtype. Up to quant_max_rows() rows stream; more dequantize the weight and
// take aten's matmul. float32 activations are used as they are (exact against the dequantized weight); bf16/fp16
// ones, with AVX2, take the integer path.
// packed may also be panels [N / 16, K / g, 8 g + 64] (pack_int4_panels; scales stay [N, 2, K / g], which the
// panels repeat): bf16/fp16 rows up to quant_max_rows() stream them on AVX-512 VNNI, the rest take the row layout.
// Or interleaved rows [N, K / 256, 128] (pack_int4_interleaved): streamed alike on AVX2 (interleaved_linear).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias) {
  if (packed.dim() == 3 && packed.size(2) == 128)
    return interleaved_linear<false>("int4_linear", x, packed, scales, group, bias,
                                     [&] { return int4_linear(x, interleaved_to_rows(packed), scales, group, bias); });
  if (packed.dim() == 3)
    return panel_linear<false>("int4_linear", x, packed, scales, group, bias, [&](int64_t N, int64_t K) {
      return int4_linear(x, panels_to_rows(packed, N, K, group), scales, group, bias);
    });
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) == 2 * packed.size(1), "int4_linear: x [M, K], w [N, K/2]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "int4_linear: contiguous uint8 weight");
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1);
  check_group_scales("int4_linear", N, K, group, scales);
  at::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  if (M > quant_max_rows() || x.stride(1) != 1) {
    auto p = packed.view({N, K / 32, 16});
    auto q = at::cat({at::bitwise_and(p, 15), at::bitwise_right_shift(p, 4)}, 2).view({N, K}).to(at::kFloat);
    auto sf = scales.to(at::kFloat);
    auto w = (q.view({N, K / group, group}) - sf.select(1, 1).unsqueeze(2)) * sf.select(1, 0).unsqueeze(2);
    at::Tensor y = at::mm(x.to(at::kFloat), w.view({N, K}).t());
    if (bp) y = y + b32;
    return y.to(x.scalar_type());
  }
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_linear", [&] {
#if LEVERLAB_QUANT_AVX2
    if constexpr (kHalfWidth<scalar_t>) {
      const int64_t bpg = group / 32;  // 2^i blocks per group: every group size we make (quant/int4.py)
      if ((bpg & (bpg - 1)) == 0) {
        int4_rows_q8<scalar_t>(x, packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), group, bp,
                               y.data_ptr<scalar_t>(), N, K);
        return;
      }
    }
#endif
    int4_rows_f32<scalar_t>(x, packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), group, bp,
                            y.data_ptr<scalar_t>(), N, K);
  });
  return y;
}

// ---- int6 ------------------------------------------------------------------------------------------------

namespace {

// Weight k of an int6 row (quant/int6.py: per 128-weight quad, 64 bytes of int4-layout nibbles, then 32 of high
// bits; add_high2 gives the plane's order), in 0..63.
inline int u6_at(const uint8_t* wr, int64_t k) {
  const int64_t i = k % 32, lane = 16 * ((k % 128) / 32) + i % 16;  // lane: in the quad's nibble vectors
  const uint8_t* quad = wr + (k / 128) * 96;
  const uint8_t nb = quad[((k % 128) / 32) * 16 + i % 16];
  const uint8_t hb = quad[64 + lane % 32];
  const int shift = (i < 16 ? 0 : 4) + (lane < 32 ? 0 : 2);
  return (i < 16 ? nb & 15 : nb >> 4) | (((hb >> shift) & 3) << 4);
}

// Row n's weights as floats (q - z) * s, into dst [K].
inline void u6_row_f32(const uint8_t* w, const at::Half* ss, int64_t n, int64_t K, int64_t g, float* dst) {
  const int64_t G = K / g;
  const uint8_t* wr = w + n * (3 * K / 4);
  const at::Half* sr = ss + n * 2 * G;
  for (int64_t k = 0; k < K; ++k)
    dst[k] = (static_cast<float>(u6_at(wr, k)) - static_cast<float>(sr[G + k / g])) * static_cast<float>(sr[k / g]);
}

// The plain path (float32 activations: exact against the dequantized weight; CPUs without AVX-512 VNNI): each
// weight row decoded once into floats, then a dot product per activation row.
template <typename T>
void int6_rows_f32(const at::Tensor& x, const uint8_t* w, const at::Half* ss, int64_t g, const float* bias, T* y,
                   int64_t N, int64_t K) {
  static thread_local std::vector<float> xbuf;
  const int64_t M = x.size(0);
  float* xs = scratch(xbuf, M * K);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data_ptr<T>() + m * x.stride(0);
    for (int64_t k = 0; k < K; ++k) xs[m * K + k] = static_cast<float>(xr[k]);
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    static thread_local std::vector<float> rbuf;
    float* wf = scratch(rbuf, K);
    for (int64_t n = n0; n < n1; ++n) {
      u6_row_f32(w, ss, n, K, g, wf);
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += wf[k] * xs[m * K + k];
        y[m * N + n] = static_cast<T>(acc + (bias ? bias[n] : 0.f));
      }
    }
  });
}

}  // namespace

bool has_fast_int6() {
#if LEVERLAB_QUANT_AVX512
  return true;
#else
  return false;
#endif
}

bool has_int6_stream() {
#if LEVERLAB_QUANT_AVX512 || LEVERLAB_QUANT_AVX2
  return true;
#else
  return false;
#endif
}

// x [M, K], packed [N, 3K/4] uint8 (u6_at's layout), scales [N, 2, K / g] fp16 -> [M, N] in x's dtype. bf16/fp16
// rows stream with integer dot products, up to quant_max_rows() of them: on AVX-512 VNNI (has_fast_int6), or on
// AVX2 with groups of 64, one row at a time (has_int6_stream); more take aten's matmul on the dequantized weight;
// the rest the plain path.
// packed may also be panels [N / 16, K / g, 12 g + 64] (pack_int6_panels), streamed as int4's panels are, or
// interleaved rows [N, K / 256, 192] (pack_int6_interleaved), as int4's.
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias) {
  if (packed.dim() == 3 && packed.size(2) == 192)
    return interleaved_linear<true>("int6_linear", x, packed, scales, group, bias, [&] {
      return int6_linear(x, int6_interleaved_to_rows(packed, packed.size(0), x.size(1)), scales, group, bias);
    });
  if (packed.dim() == 3)
    return panel_linear<true>("int6_linear", x, packed, scales, group, bias, [&](int64_t N, int64_t K) {
      return int6_linear(x, int6_panels_to_rows(packed, N, K, group), scales, group, bias);
    });
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) % 128 == 0 && 3 * x.size(1) == 4 * packed.size(1),
              "int6_linear: x [M, K], w [N, 3K/4], K a multiple of 128");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "int6_linear: contiguous uint8 weight");
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1);
  check_group_scales("int6_linear", N, K, group, scales);
  at::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* ss = scales.data_ptr<at::Half>();
  if (M > quant_max_rows() || x.stride(1) != 1) {
    at::Tensor wf = at::empty({N, K}, at::kFloat);
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) u6_row_f32(w, ss, n, K, group, wf.data_ptr<float>() + n * K);
    });
    at::Tensor y = at::mm(x.to(at::kFloat), wf.t());
    if (bp) y = y + b32;
    return y.to(x.scalar_type());
  }
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int6_linear", [&] {
#if LEVERLAB_QUANT_AVX512
    if constexpr (kHalfWidth<scalar_t>) {
      const int64_t bpg = group / 32;
      if ((bpg & (bpg - 1)) == 0) {
        int4_rows_q8<scalar_t, true>(x, w, ss, group, bp, y.data_ptr<scalar_t>(), N, K);
        return;
      }
    }
#elif LEVERLAB_QUANT_AVX2
    // AVX2: the single stream with groups of 64 (u4_row_g64x4), row by row: more rows re-read the weight per row,
    // and the loader's timing (quant/autotune.py) gives them fbgemm's GEMM over the int8 copy instead.
    if constexpr (kHalfWidth<scalar_t>) {
      if (group == 64) {
        for (int64_t m = 0; m < M; ++m)
          int4_rows_q8<scalar_t, true>(x.narrow(0, m, 1), w, ss, group, bp, y.data_ptr<scalar_t>() + m * N, N, K);
        return;
      }
    }
#endif
    int6_rows_f32<scalar_t>(x, w, ss, group, bp, y.data_ptr<scalar_t>(), N, K);
  });
  return y;
}
