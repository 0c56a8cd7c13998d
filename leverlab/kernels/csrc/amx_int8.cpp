// int8 x int8 GEMM on AMX tiles (Intel Sapphire Rapids and later): y = (q(x) W^T) * s_x * s_w for many rows.
//
// Why: quantized layers run their batched rows (prefill chunks, and decode batches past the streaming kernels'
// crossover) through an int8 GEMM over an int8 copy of the weight (quant/int8_gemm.py). fbgemm's is AVX-512 VNNI,
// ~64 multiply-adds per cycle per core; one AMX TDPBSSD does 16 x 16 x 64 in ~16 cycles, 1,024 per cycle. On a
// 2-vCPU Xeon with AMX, fbgemm ran the Qwen3-0.6B shape's layer GEMMs at 1,024 rows at ~185 G
// multiply-adds per second, oneDNN's AMX bf16 matmul at ~310, while a plain tile loop here ran 650-1,300: so an
// int8 or int4 model prefilled at half the rate of the same model in bf16.
//
// Layout. The weight is held as plain int8 rows, [Np, Kp] (quant/int8_gemm.py pack_amx): Np a multiple of 32, Kp of
// 64, padded with zeros. 16 of its rows x 64 bytes (stride Kp) is an A tile, so the weight is the A operand and the
// activations the B one, as in amx_bf16.cpp: C = A B is y^T. Activations are quantized per row, symmetric:
// q = round(x * 127 / max|x|), s_x = max|x| / 127, straight into B tiles, [Mp/16][Kp/64][16 r][16 m][4] bytes
// (row r of a tile holds k = 4r .. 4r + 3 of 16 activation rows, the VNNI order TDPBSSD reads), Mp a multiple of
// 32, zero past M. Each step of the inner loop multiplies 32 weight rows by 32 activation rows: two A tiles, two B
// tiles, four C tiles of int32 sums (|sum| <= K * 127 * 127 fits int32 for K < 133,000).
// Why the weight is A: it had been held as B tiles (16 columns' 64 bytes of K in VNNI order, a tile 1 KB
// contiguous). A pass over the Qwen3-0.6B shape's 112 matrices, both layouts alternating in one process (two
// threads, medians of 8): 1 row 53.4 -> 36.3 ms in a busy spell, 29.9 -> 23.1 in a quiet one; 16 rows 58.6 -> 41.2
// and 33.3 -> 25.2; 256 rows 310 -> 212; 32 rows 65.0 -> 67.1 (slower, left); 1,024 rows level.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_int8.h"
#include "amx_util.h"
#include "row_split.h"
#if defined(LEVERLAB_AMX_TILE) && defined(__AMX_INT8__)
#define LEVERLAB_AMX 1
#endif

namespace {

constexpr int64_t kRows = 32;      // activation rows per step (two B tiles)
constexpr int64_t kCols = 32;      // weight rows (output columns) per step (two A tiles)
constexpr int64_t kDepth = 64;     // K bytes per tile row
// Activation rows are taken in chunks whose B tiles (Kp bytes a row) stay in L2 while every weight row passes over
// them; each chunk reads the whole weight again, from memory. 1 MB of them (half a Sapphire Rapids core's L2):
// the Qwen3-0.6B shape's 112 GEMMs at 1,024 rows, cold weights, one thread, best of 4 interleaved: 785 ms with
// 256-row chunks (the whole weight read four times), 749 with 1 MB (1,024 rows at K 1,024, 512 at 2,048, 320 at
// 3,072), 744 / 771 / 782 with 2 / 4 / 8 MB (the K 1,024 GEMMs 10% faster with one pass, the others slower again).
constexpr int64_t kChunkBytes = 1 << 20;

#ifdef LEVERLAB_AMX
// 16 elements of x as float32 (bf16: its bits shifted up; fp16: converted; float: loaded).
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// Row m of x quantized into row (Kp bytes, zero past K); returns its scale s_x. The vector and scalar parts round
// alike (to nearest even: VCVTPS2DQ under the default MXCSR, std::nearbyint), so a row's int8 values do not depend
// on K's remainder; quant/int8_gemm.py's reference computes the same.
template <typename T>
float quantize_row(const T* xr, int64_t K, int64_t Kp, int8_t* row) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(xr + k)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xr[k])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (k = 0; k + 16 <= K; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + k), vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + k), _mm512_cvtsepi32_epi8(v));
  }
  for (; k < K; ++k) row[k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xr[k]) * inv));
  std::memset(row + K, 0, static_cast<size_t>(Kp - K));
  return amax / 127.f;
}

// Activation rows 16 g .. 16 g + 15 of x (zero from M on) quantized into their B tiles, xb + g (Kp / 64) KB:
// [Kp/64][16 r][16 m][4] bytes, row r of tile kc holding k = 64 kc + 4 r .. + 3 of the 16 rows (the VNNI order
// TDPBSSD reads), with their scales sx[16 g ..]. The rows are quantized row-major into `rows` (16 x Kp scratch),
// then each tile is a 16 x 16 transpose of 32-bit words. (Scattered 4 bytes at a time, this had been ~12% of the
// GEMM's time at K 1,024: perf over the 0.6B shape's 1,024-row GEMMs.)
template <typename T>
void quantize_group(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t g, int8_t* xb, float* sx, int8_t* rows) {
  for (int r = 0; r < 16; ++r) {
    const int64_t m = 16 * g + r;
    if (m < M)
      sx[m] = quantize_row(x + m * K, K, Kp, rows + r * Kp);
    else
      std::memset(rows + r * Kp, 0, static_cast<size_t>(Kp));
  }
  int8_t* tiles = xb + g * (Kp / kDepth) * 1024;
  for (int64_t kc = 0; kc < Kp / kDepth; ++kc) {
    __m512i w[16];
    for (int r = 0; r < 16; ++r) w[r] = _mm512_loadu_si512(rows + r * Kp + kc * kDepth);
    amx::transpose16(w);  // w[i] lane m: row m's bytes 4 i .. 4 i + 3 of this chunk
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tiles + kc * 1024 + 64 * i, w[i]);
  }
}

// One block of sums, c [32 weight rows][32 activation rows]: the weight's rows a (stride Kp) against the B tiles of
// Mb groups of 16 activation rows, b0 and b1 (each Kp/64 tiles of 1 KB). A decode batch of 16 rows or fewer takes
// one group (Mb = 1): half the tile products, which matter when the tiles are shared with a busy neighbour.
// between(kc) runs after step kc's tile products are issued: the previous block's epilogue, which the vector ports
// then run while the tiles work (see Pipeline).
template <int Mb, typename Between>
inline void block_sums(const int8_t* a, int64_t Kp, const int8_t* b0, const int8_t* b1, int32_t* c,
                       Between&& between) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (Mb == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kc = 0; kc < Kp / kDepth; ++kc) {
    _tile_loadd(4, a + kc * kDepth, Kp);
    _tile_loadd(5, a + 16 * Kp + kc * kDepth, Kp);
    _tile_loadd(6, b0 + kc * 1024, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(2, 5, 6);
    if constexpr (Mb == 2) {
      _tile_loadd(7, b1 + kc * 1024, 64);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
    between(kc);
  }
  _tile_stored(0, c, kRows * 4);
  _tile_stored(2, c + 16 * kRows, kRows * 4);
  if constexpr (Mb == 2) {
    _tile_stored(1, c + 16, kRows * 4);
    _tile_stored(3, c + 16 * kRows + 16, kRows * 4);
  }
}

// The lanes of `keep` of 16 float32 results stored as T (bf16 rounded to nearest even in integer lanes, as c10
// rounds finite values).
template <typename T>
inline void store16(T* p, __m512 v, __mmask16 keep) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, keep, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_mask_storeu_epi16(p, keep, _mm512_cvtepi32_epi16(r));
  } else {
    _mm256_mask_storeu_epi16(p, keep, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

// y[m][n] = sum * s_x[m] * s_w[n] for the block's activation rows 16 h .. 16 h + 15 that are valid (the last block
// of either dimension may be partial): each 16 x 16 quadrant of c (weight rows by activation rows) transposed into
// 16 rows of y. sx, sw and y start at the block's first activation row and weight row; ldy: elements between rows
// of y. A whole bf16 block row is rounded and stored as one 64-byte line (VCVTNE2PS2BF16 rounds to nearest even, as
// store16 does for every finite value that is not subnormal): two 32-byte masked stores a row had cost ~10% of a
// 1,024-row GEMM's time.
template <typename T>
void store_half(const int32_t* c, const float* sx, const float* sw, int64_t rows, int64_t cols, T* y, int64_t ldy,
                int h) {
  if (16 * h >= rows) return;
  const int64_t n_rows = std::min<int64_t>(16, rows - 16 * h);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (cols == kCols) {
      __m512i lo[16], hi[16];  // weight rows 0..15 and 16..31, then transposed: activation row 16 h + j in [j]
      for (int i = 0; i < 16; ++i) {
        lo[i] = _mm512_load_si512(c + i * kRows + 16 * h);
        hi[i] = _mm512_load_si512(c + (16 + i) * kRows + 16 * h);
      }
      amx::transpose16(lo);
      amx::transpose16(hi);
      const __m512 sw0 = _mm512_loadu_ps(sw), sw1 = _mm512_loadu_ps(sw + 16);
      for (int64_t j = 0; j < n_rows; ++j) {
        const __m512 s = _mm512_set1_ps(sx[16 * h + j]);
        const __m512 l = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo[j]), s), sw0);
        const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi[j]), s), sw1);
        _mm512_storeu_si512(y + (16 * h + j) * ldy, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(u, l)));
      }
      return;
    }
  }
  const uint32_t keep = cols >= 32 ? ~0u : (1u << cols) - 1;
  for (int g = 0; g < 2 && 16 * g < cols; ++g) {
    const __mmask16 keep_g = static_cast<__mmask16>(keep >> (16 * g));
    const __m512 sw_g = _mm512_maskz_loadu_ps(keep_g, sw + 16 * g);
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + (16 * g + i) * kRows + 16 * h);
    amx::transpose16(r);  // r[j]: activation row 16 h + j, weight rows 16 g .. + 15
    for (int64_t j = 0; j < n_rows; ++j) {
      const int64_t m = 16 * h + j;
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(r[j]), _mm512_set1_ps(sx[m])), sw_g);
      store16(y + m * ldy + 16 * g, v, keep_g);
    }
  }
}

// Every row of x quantized into B tiles (xb, Mp x Kp bytes, zero-padded) with their scales sx (Mp).
template <typename T>
void quantize_all(const T* x, int64_t M, int64_t K, int64_t Kp, amx::tile_vector<int8_t>& xb,
                  std::vector<float>& sx) {
  const int64_t Mp = (M + kRows - 1) / kRows * kRows;
  xb.resize(static_cast<size_t>(Mp * Kp));  // every byte written below (rows past M as zeros)
  sx.assign(static_cast<size_t>(Mp), 0.f);
  at::parallel_for(0, Mp / 16, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int8_t> rows(static_cast<size_t>(16 * Kp));
    for (int64_t g = g0; g < g1; ++g) quantize_group(x, M, K, Kp, g, xb.data(), sx.data(), rows.data());
  });
}

// One thread's blocks in order, each block's epilogue deferred and run in pieces between the tile steps of the block
// after it. Why: the tiles and the vector ports work in parallel only where the out-of-order window holds both, and a
// block's epilogue (its sums stored, transposed, scaled, rounded and written: ~800 instructions) run after its tile
// products had kept the tiles idle for as long as it took. A stand-alone loop of these kernels (the 0.6B shape's qkv
// at 1,024 rows, one thread of that Xeon): 1,770 G multiply-adds a second with no epilogue, 845 with it run after
// each block, 1,080 with it deferred into the next block's steps, 1,060 run after each block but with its stores
// made whole 64-byte lines; this kernel, both together and its quantization included, 1,030-1,080 over the 0.6B
// shape's four GEMMs (scripts/profile_prefill.py --gemms). After the last block, flush() runs what is left.
template <typename T>
class Pipeline {
 public:
  Pipeline(const int8_t* packed, int64_t Kp, const amx::tile_vector<int8_t>& xb, const float* sx, const float* sw,
           int64_t M)
      : packed_(packed), Kp_(Kp), xb_(xb), sx_(sx), sw_(sw), M_(M) {}

  // Block (weight rows [n, n + cols), activation rows [m0, m0 + 32), fewer at M): its outputs go to y (the block's
  // first row and column, ldy elements between rows), then, where epi is given, epi(g, m0, rows, out, ld) runs on
  // the group the block completes (y then points into out).
  void block(int64_t n, int64_t m0, int64_t cols, T* y, int64_t ldy, const AmxEpilogue<T>* epi = nullptr,
             int64_t g = 0, const T* out = nullptr, int64_t ld = 0) {
    int32_t* c = c_[par_];
    const int8_t* b0 = xb_.data() + (m0 / 16) * (Kp_ / kDepth) * 1024;
    const int64_t steps = Kp_ / kDepth;
    const int pieces = pending_.pieces();
    // piece p after step (p + 1) steps / (pieces + 1): spread over the block
    auto between = [&](int64_t kc) {
      while (done_ < pieces && (kc + 1) * (pieces + 1) >= (done_ + 1) * steps) run_piece(done_++);
    };
    if (M_ - m0 <= 16)
      block_sums<1>(packed_ + n * Kp_, Kp_, b0, nullptr, c, between);
    else
      block_sums<2>(packed_ + n * Kp_, Kp_, b0, b0 + (Kp_ / kDepth) * 1024, c, between);
    while (done_ < pieces) run_piece(done_++);
    pending_ = {c, sx_ + m0, sw_ + n, std::min(kRows, M_ - m0), cols, y, ldy, epi, g, m0, out, ld};
    done_ = 0;
    par_ ^= 1;
  }

  void flush() {
    while (done_ < pending_.pieces()) run_piece(done_++);
    pending_.c = nullptr;
  }

 private:
  struct Pending {
    const int32_t* c = nullptr;  // null: nothing pending
    const float *sx, *sw;
    int64_t rows, cols;
    T* y;
    int64_t ldy;
    const AmxEpilogue<T>* epi;
    int64_t g, m0;
    const T* out;
    int64_t ld;
    int pieces() const { return c == nullptr ? 0 : (epi != nullptr ? 3 : 2); }
  };

  void run_piece(int p) {
    const Pending& q = pending_;
    if (p < 2)
      store_half(q.c, q.sx, q.sw, q.rows, q.cols, q.y, q.ldy, p);
    else
      (*q.epi)(q.g, q.m0, q.rows, q.out, q.ld);
  }

  const int8_t* packed_;
  int64_t Kp_;
  const amx::tile_vector<int8_t>& xb_;
  const float *sx_, *sw_;
  int64_t M_;
  alignas(64) int32_t c_[2][kCols * kRows];  // this block's sums and the pending block's
  int par_ = 0;
  Pending pending_;
  int done_ = 0;  // pieces of pending_ run
};

// Activation rows are taken in chunks whose B tiles stay in L2 (kChunkBytes).
inline int64_t chunk_rows_for(int64_t Kp) { return std::max(kRows, kChunkBytes / Kp / kRows * kRows); }

template <typename T>
void amx_gemm(const T* x, int64_t M, int64_t K, const int8_t* packed, int64_t Np, int64_t Kp, const float* sw,
              int64_t N, T* y) {
  amx::tile_vector<int8_t> xb;
  std::vector<float> sx;
  quantize_all(x, M, K, Kp, xb, sx);
  const int64_t Mp = static_cast<int64_t>(sx.size()), chunk_rows = chunk_rows_for(Kp);
  for (int64_t c0 = 0; c0 < Mp; c0 += chunk_rows) {
    const int64_t c1 = std::min(Mp, c0 + chunk_rows);
    parallel_rows(Np, [&](int64_t n0, int64_t n1) {  // chunks of 64 rows or more: whole blocks of 32
      _tile_loadconfig(&amx::kConfig);
      Pipeline<T> pipe(packed, Kp, xb, sx.data(), sw, M);
      for (int64_t n = n0; n < n1 && n < N; n += kCols)
        for (int64_t m0 = c0; m0 < c1 && m0 < M; m0 += kRows)
          pipe.block(n, m0, std::min(kCols, N - n), y + m0 * N + n, N);
      pipe.flush();
      _tile_release();  // a thread holding no tile state saves and restores less on every context switch
    });
  }
}
#endif

}  // namespace

bool amx_int8_available() {
#ifdef LEVERLAB_AMX
  return amx::permitted();
#else
  return false;
#endif
}

at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale) {
  TORCH_CHECK(amx_int8_available(), "amx_int8_linear: this build or CPU has no AMX int8 (amx_int8_available())");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.size(0) % kCols == 0 &&
                  packed.size(1) % kDepth == 0,
              "amx_int8_linear: x [M, K], packed int8 [Np, Kp] with Np a multiple of 32 and Kp of 64");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat,
              "amx_int8_linear: x must be bfloat16, float16 or float32, not ", dt);
  const int64_t M = x.size(0), K = x.size(1), Np = packed.size(0), Kp = packed.size(1);
  const int64_t N = w_scale.numel();
  TORCH_CHECK(K <= Kp && Kp < K + kDepth && N <= Np && Np < N + kCols && w_scale.scalar_type() == at::kFloat,
              "amx_int8_linear: x's K ", K, " and w_scale's N ", N, " do not match the packed weight (", Np, " x ",
              Kp, "), or w_scale is not float32");
  const at::Tensor xc = x.contiguous(), pc = packed.contiguous(), sc = w_scale.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef LEVERLAB_AMX
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "amx_int8_linear", [&] {  // not double: checked
    amx_gemm<scalar_t>(xc.data_ptr<scalar_t>(), M, K, pc.data_ptr<int8_t>(), Np, Kp, sc.data_ptr<float>(), N,
                       y.data_ptr<scalar_t>());
  });
#endif
  return y;
}

// The same GEMM over groups of whole 32-row weight blocks, each group's outputs handed to `epi` while they are in
// L1 instead of written to a [M, N] output: see amx_int8.h.
template <typename T>
void amx_int8_grouped(const T* x, int64_t M, int64_t K, const at::Tensor& packed, const at::Tensor& w_scale,
                      const std::vector<int64_t>& block_rows, int64_t per_group, const AmxEpilogue<T>& epi) {
  TORCH_CHECK(amx_int8_available(), "amx_int8_grouped: this build or CPU has no AMX int8");
  const int64_t Kp = packed.size(1), groups = static_cast<int64_t>(block_rows.size()) / per_group;
  TORCH_CHECK(per_group > 0 && groups * per_group == static_cast<int64_t>(block_rows.size()) && K <= Kp &&
                  Kp < K + kDepth && packed.is_contiguous() && w_scale.is_contiguous(),
              "amx_int8_grouped: blocks of whole groups, x's K matching the packed weight");
  for (int64_t n : block_rows)
    TORCH_CHECK(n % kCols == 0 && n + kCols <= w_scale.numel(), "amx_int8_grouped: whole blocks of 32 rows");
  if (M == 0) return;
#ifdef LEVERLAB_AMX
  const int8_t* pw = packed.data_ptr<int8_t>();
  const float* sw = w_scale.data_ptr<float>();
  amx::tile_vector<int8_t> xb;
  std::vector<float> sx;
  quantize_all(x, M, K, Kp, xb, sx);
  const int64_t Mp = static_cast<int64_t>(sx.size()), chunk_rows = chunk_rows_for(Kp), ld = per_group * kCols;
  for (int64_t c0 = 0; c0 < Mp; c0 += chunk_rows) {
    const int64_t c1 = std::min(Mp, c0 + chunk_rows);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      _tile_loadconfig(&amx::kConfig);
      Pipeline<T> pipe(pw, Kp, xb, sx.data(), sw, M);
      // two group outputs: the pending group's epi reads one while the next group's blocks are stored in the other
      std::vector<T> out(static_cast<size_t>(2 * kRows * ld));
      int par = 0;
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t m0 = c0; m0 < c1 && m0 < M; m0 += kRows, par ^= 1) {
          T* o = out.data() + par * kRows * ld;
          for (int64_t j = 0; j < per_group; ++j)
            pipe.block(block_rows[g * per_group + j], m0, kCols, o + j * kCols, ld,
                       j + 1 == per_group ? &epi : nullptr, g, o, ld);
        }
      pipe.flush();
      _tile_release();
    });
  }
#else
  (void)x, (void)K, (void)epi;
#endif
}

template void amx_int8_grouped<float>(const float*, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                                      const std::vector<int64_t>&, int64_t, const AmxEpilogue<float>&);
template void amx_int8_grouped<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const at::Tensor&,
                                              const at::Tensor&, const std::vector<int64_t>&, int64_t,
                                              const AmxEpilogue<c10::BFloat16>&);
template void amx_int8_grouped<c10::Half>(const c10::Half*, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                                          const std::vector<int64_t>&, int64_t, const AmxEpilogue<c10::Half>&);
template <>
void amx_int8_grouped<double>(const double*, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                              const std::vector<int64_t>&, int64_t, const AmxEpilogue<double>&) {
  TORCH_CHECK(false, "amx_int8_grouped: float64 activations are not taken");
}
