// y = x W^T (+ b) in bfloat16 with W held in tile order: every bf16 layer of a model on a CPU with AMX-BF16
// (models/loader.py tile_bf16_layers), for every row count: our AMX kernel for decode rows, oneDNN past them.
//
// Why a layout of its own: a decode step streams every weight once, and how fast one core streams depends on the
// order it asks for the lines. amx_bf16.cpp reads W in place, an A tile being 16 rows x 64 bytes at a stride of
// K * 2 bytes: 32 row streams at once, which one core of a 2-vCPU Xeon (family 6 model 167, AMX) served at 14.5
// GB/s, the rate of a plain sum, and no software prefetch made faster. Held so that each step of the loop reads 2 KB
// contiguous, with the next 2 KB requested into L2 (PREFETCHT1) a step ahead, the same tile products read 17-18 GB/s
// (a stand-alone loop over 28 matrices of the 0.6B shape's gate_up, huge pages; the sum with the same prefetch 19).
// Two more things were needed to keep that rate with the outputs written (measured in the same loop):
//  - W is the B operand (16 pairs of K x 16 output columns a tile) and x the A one, so C is y itself, [16 m][16 n],
//    and a row of y is two C rows converted: no transposes (W as A, transposed out: 15.4 GB/s; as B: 15.8-16.0).
//  - A decode batch's outputs are written with non-temporal stores. Ordinary stores of the 16 lines of y a block
//    writes took the stream from 17 to 14 GB/s on their own: each missed L1, and while they waited for lines the
//    loads and prefetches behind them did too. The next op reads y back from memory.
//
// Why this order of the tiles' rows: it is oneDNN's. oneDNN packs a bf16 weight for a prefill-sized GEMM on AMX
// into blocks of 32 output columns, [N/32][K/2][32][2] (its BA16a32b2a), which holds the same 2 KB per block and step
// as our tiles, its two B tiles' rows side by side (128 bytes a row) where ours had been one tile after the other.
// So the bytes the decode kernel streams are the weight oneDNN multiplies a prompt by: prefill-sized calls go to
// oneDNN's prepacked linear (mkldnn::_linear_pointwise, as inductor uses it) over the tiles in place, through a
// tensor of PyTorch's mkldnn layout that views them. Python checks, once per shape, that oneDNN packs such a weight
// into exactly these bytes before it hands the shape's descriptor over (set_onednn_md); a shape without one goes to
// aten's GEMM over the rows put back, a chunk at a time. Before, with a tile order of our own, the decoder layers'
// prefill ran on a tile GEMM of ours at ~75% of oneDNN's rate (a 1,024-token prefill 1,126-1,155 -> 1,311-1,363 ms)
// or on the rows put back (1,411-1,416 against 1,213-1,269), so only the output head had been held this way.
// The interleaved rows cost the stream: a tile load takes every other line of a step, and in that order the loop
// read 14.6 GB/s where the tile-after-tile order had read 17.4-18.4. Requesting the step's next 16 lines into L1 in
// address order (PREFETCHT0, kL1Ahead) took it back to 17.4-17.8 (stand-alone, the same loop; 16 rows 16.3-17.1
// against 16.4-17.1).
// The sums are the same, in the same order, as amx_bf16.cpp's: decode outputs are bit for bit the same
// (tests/engine/test_amx_bf16_tiles.py).
//
// Layout ("tiles"), for W [N, K] row-major, K a multiple of 32, N padded with zero rows to Np, a multiple of 32:
// [Np/32 blocks][K/32 steps][16 r][32 n][2], i.e. block b, step s holds the pairs W[32 b + n][32 s + 2 r], [.. + 1];
// B tile h (output columns 16 h .. 16 h + 15) is the 64 bytes at 64 h of each of the 16 rows of 128 bytes.
// As a tensor it is [Np/32, K/32, 1024] bf16, so that nothing takes it for a row-major [N, K] weight.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "amx_util.h"
#include "kernel_util.h"
#include "row_split.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if defined(LEVERLAB_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LEVERLAB_AMX_BF16_TILES 1
#endif

bool amx_bf16_enabled();

namespace {

constexpr int64_t kBlock = 32;      // output columns (weight rows) per block: two B tiles
constexpr int64_t kDepth = 32;      // bf16 elements of K per step
constexpr int64_t kStepElems = 2 * 512;  // a block's two B tiles of one step
constexpr int64_t kMaxDecodeRows = 32;   // up to here: one pass over the weights, streamed
constexpr int64_t kAhead = 1024;         // bytes past the step's start requested into L2 (1-3 KB measured alike)
constexpr int64_t kL1Ahead = 512;        // bytes past the step's start requested into L1 (16 lines)
constexpr int64_t kRowBytes = 128;       // a step's row r: 32 output columns' pairs (two B tiles' rows side by side)

#ifdef LEVERLAB_AMX_BF16_TILES
// Block b's tiles from w [N, K]: per step and half, a 16 x 16 transpose of 32-bit words (a word: one K pair).
void pack_block(const uint16_t* w, int64_t N, int64_t K, int64_t b, uint16_t* out) {
  const int64_t steps = K / kDepth;
  for (int64_t s = 0; s < steps; ++s)
    for (int h = 0; h < 2; ++h) {
      __m512i v[16];
      for (int n = 0; n < 16; ++n) {
        const int64_t row = b * kBlock + 16 * h + n;
        v[n] = row < N ? _mm512_loadu_si512(w + row * K + s * kDepth) : _mm512_setzero_si512();
      }
      amx::transpose16(v);  // v[r] lane n: row n's pair r
      uint16_t* t = out + (b * steps + s) * kStepElems + h * 32;  // row r: half 0's 16 pairs, then half 1's
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(t + 64 * r, v[r]);
    }
}

// x [M, K] (row stride ldx) -> xa, its A tiles in order: [Mp/16 groups][K/32 steps][16 rows][32], zero past M:
// each tile 1 KB contiguous and aligned.
void pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, uint16_t* xa) {
  const int64_t steps = K / kDepth;
  for (int64_t m = 0; m < Mp; ++m) {
    uint16_t* dst = xa + (m / 16) * steps * 512 + (m % 16) * kDepth;
    if (m < M)
      for (int64_t s = 0; s < steps; ++s) std::memcpy(dst + s * 512, x + m * ldx + s * kDepth, kDepth * 2);
    else
      for (int64_t s = 0; s < steps; ++s) std::memset(dst + s * 512, 0, kDepth * 2);
  }
}

// The sums of one block (its tiles at wb) against Mb groups of 16 rows of xa (pack_x's order): c [Mb][2 halves][16 m]
// [16 n] float32, the stream's next 2 KB requested into L2 a step ahead.
template <int Mb>
inline void block_sums(const uint16_t* wb, int64_t K, const uint16_t* xa, float* c) {
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (Mb == 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < K / kDepth; ++s) {
    const uint16_t* b = wb + s * kStepElems;
    const char* p = reinterpret_cast<const char*>(b);
    for (int i = 0; i < 32; ++i) _mm_prefetch(p + kAhead + 64 * i, _MM_HINT_T1);
    // and the lines the tile loads take next into L1, in address order: each tile load takes every other line of
    // the step (half 0 the even ones), an order that alone streamed 14.6 GB/s where this reads 17-18 (kL1Ahead)
    for (int i = 0; i < 16; ++i) _mm_prefetch(p + kL1Ahead + 64 * i, _MM_HINT_T0);
    _tile_loadd(2, xa + s * 512, 64);
    _tile_loadd(0, b, kRowBytes);  // half 0: the first 64 bytes of each 128-byte row
    _tile_loadd(1, b + 32, kRowBytes);
    _tile_dpbf16ps(4, 2, 0);
    _tile_dpbf16ps(5, 2, 1);
    if constexpr (Mb == 2) {
      _tile_loadd(3, xa + 16 * K + s * 512, 64);
      _tile_dpbf16ps(6, 3, 0);
      _tile_dpbf16ps(7, 3, 1);
    }
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  if constexpr (Mb == 2) {
    _tile_stored(6, c + 512, 64);
    _tile_stored(7, c + 768, 64);
  }
}

// y[m, n0 .. n0 + cols) for the block's first `rows` rows: C's two halves of row m (+ bias), rounded to bf16 once
// (VCVTNE2PS2BF16: to nearest even, as aten rounds). Stream: non-temporal stores (whole, aligned lines only).
inline void store_rows(const float* c, int64_t rows, const float* bias, int64_t n0, int64_t cols, uint16_t* y,
                       int64_t ldy, bool stream) {
  const __mmask32 keep = cols >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << cols) - 1);
  __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
  if (bias) {
    b_lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep), bias + n0);
    b_hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> 16), bias + n0 + 16);
  }
  for (int64_t m = 0; m < rows; ++m) {
    const float* cm = c + (m / 16) * 512 + (m % 16) * 16;
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(cm), b_lo), hi = _mm512_add_ps(_mm512_load_ps(cm + 256), b_hi);
    const __m512i v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    uint16_t* dst = y + m * ldy + n0;
    if (stream && cols == 32)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
    else
      _mm512_mask_storeu_epi16(dst, keep, v);
  }
}

// 1..32 rows: one pass over the weights, each block against every row.
template <int Mb>
void decode(const uint16_t* tiles, int64_t Np, int64_t K, const uint16_t* xa, int64_t M, const float* bias,
            int64_t N, uint16_t* y, bool stream) {
  parallel_rows(Np, [&](int64_t n0, int64_t n1) {  // chunks of 64 rows or more: whole blocks
    _tile_loadconfig(&amx::kConfig);
    alignas(64) float c[Mb * 512];
    for (int64_t n = n0; n < n1 && n < N; n += kBlock) {
      block_sums<Mb>(tiles + (n / kBlock) * (K / kDepth) * kStepElems, K, xa, c);
      store_rows(c, M, bias, n, std::min(kBlock, N - n), y, N, stream);
    }
    if (stream) _mm_sfence();  // the streamed lines visible before another thread reads y
    _tile_release();  // a thread holding no tile state saves and restores less on every context switch
  });
}

// Tiles [b0, b1) of a [.., K] weight back into rows, out [(b1 - b0) * 32, K]: per step and half, the transpose
// pack_block made, undone.
void unpack_blocks(const uint16_t* tiles, int64_t K, int64_t b0, int64_t b1, uint16_t* out) {
  const int64_t steps = K / kDepth;
  at::parallel_for(b0, b1, 4, [&](int64_t c0, int64_t c1) {
    for (int64_t b = c0; b < c1; ++b)
      for (int64_t s = 0; s < steps; ++s)
        for (int h = 0; h < 2; ++h) {
          const uint16_t* t = tiles + (b * steps + s) * kStepElems + h * 32;
          __m512i v[16];
          for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_si512(t + 64 * r);
          amx::transpose16(v);  // v[n]: row n's 16 pairs of this step
          for (int n = 0; n < 16; ++n)
            _mm512_storeu_si512(out + ((b - b0) * kBlock + 16 * h + n) * K + s * kDepth, v[n]);
        }
  });
}

// More rows, for a shape oneDNN has no descriptor of here: aten's GEMM over the weight put back in rows, kChunkBytes
// of it at a time into a scratch buffer that stays in cache for the GEMM to read (a head of 151,936 x 1,024 is 19
// chunks).
constexpr int64_t kChunkBytes = 16 << 20;

void gemm(const torch::Tensor& x2, const uint16_t* tiles, int64_t K, const c10::optional<torch::Tensor>& bias,
          int64_t N, torch::Tensor& y) {
  static thread_local torch::Tensor scratch;  // reused: a fresh 16 MB each call would fault its pages in again
  const int64_t rows = std::max<int64_t>(kBlock, kChunkBytes / (K * 2) / kBlock * kBlock);
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t n1 = std::min(N, n0 + rows), nb = (n1 - n0 + kBlock - 1) / kBlock;
    if (!scratch.defined() || scratch.numel() < nb * kBlock * K)
      scratch = torch::empty({nb * kBlock * K}, x2.options());
    auto sp = reinterpret_cast<uint16_t*>(scratch.data_ptr<at::BFloat16>());
    unpack_blocks(tiles, K, n0 / kBlock, n0 / kBlock + nb, sp);
    const torch::Tensor w = scratch.narrow(0, 0, (n1 - n0) * K).view({n1 - n0, K});
    const c10::optional<torch::Tensor> b = bias.has_value() && bias->defined()
                                               ? c10::optional<torch::Tensor>(bias->narrow(0, n0, n1 - n0))
                                               : c10::nullopt;
    if (n0 == 0 && n1 == N)
      y = at::linear(x2, w, b);
    else
      y.narrow(1, n0, n1 - n0).copy_(at::linear(x2, w, b));
  }
}

// oneDNN's descriptors of this layout: per weight shape [n, K], the serialized memory descriptor oneDNN gives a
// bf16 weight it packs for a prefill-sized GEMM, set from Python once it has checked that oneDNN packs such a weight
// into exactly these bytes (layers/bf16_linear.py onednn_reads).
std::mutex g_md_mutex;
std::map<std::pair<int64_t, int64_t>, std::vector<uint8_t>> g_md;

// y = x2 W^T (+ b) by oneDNN reading the tiles where they are, as its own prepacked weight: a tensor of PyTorch's
// mkldnn layout viewing them (it owns nothing), and the prepacked linear inductor calls (mkldnn::_linear_pointwise).
// False where no descriptor is known for this shape.
bool onednn_linear(const torch::Tensor& x2, const torch::Tensor& tiles, int64_t n, int64_t K,
                   const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  std::vector<uint8_t> md;
  {
    std::lock_guard<std::mutex> lock(g_md_mutex);
    auto it = g_md.find({n, K});
    if (it == g_md.end()) return false;
    md = it->second;
  }
  const int64_t sizes[2] = {n, K}, strides[2] = {K, 1};
  AtenTensorHandle handle = nullptr;
  TORCH_CHECK(aoti_torch_create_tensor_from_blob_v2(tiles.data_ptr(), 2, sizes, strides, 0, aoti_torch_dtype_bfloat16(),
                                                    aoti_torch_device_type_cpu(), 0, &handle,
                                                    aoti_torch_layout__mkldnn(), md.data(),
                                                    static_cast<int64_t>(md.size())) == AOTI_TORCH_SUCCESS,
              "linear_bf16_tiles: PyTorch would not view the tiles as a oneDNN weight");
  const at::Tensor w = *reinterpret_cast<at::Tensor*>(handle);  // shares the view; the handle goes
  aoti_torch_delete_tensor_object(handle);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                         std::optional<c10::string_view>)>();
  const std::optional<at::Tensor> b =
      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  y = op.call(x2.contiguous(), w, b, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
  return true;
}
#endif

void check_tiles(const torch::Tensor& tiles) {
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 3 && tiles.size(2) == kStepElems &&
                  tiles.is_contiguous(),
              "linear_bf16_tiles: tiles [Np/32, K/32, 1024] bfloat16 (amx_bf16_pack's layout)");
}

}  // namespace

// Whether this build and CPU run the tile-order kernels (amx_bf16_enabled: built with AMX-BF16, granted by the OS,
// not switched off by LEVERLAB_NO_AMX=1).
bool amx_bf16_tiles_available() {
#ifdef LEVERLAB_AMX_BF16_TILES
  return amx_bf16_enabled();
#else
  return false;
#endif
}

// w [N, K] bf16 (K a multiple of 32) -> its tiles, [ceil(N/32), K/32, 1024].
torch::Tensor amx_bf16_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) % kDepth == 0,
              "amx_bf16_pack: w [N, K] bfloat16 with K a multiple of ", kDepth);
  const torch::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kBlock - 1) / kBlock;
  auto out = torch::empty({blocks, K / kDepth, kStepElems}, w.options());
#ifdef LEVERLAB_AMX_BF16_TILES
  auto wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) pack_block(wp, N, K, b, op);
  });
#else
  TORCH_CHECK(false, "amx_bf16_pack: this build has no AMX-BF16");
#endif
  return out;
}

// The serialized oneDNN memory descriptor (uint8 [bytes]) of a [n, k] bf16 weight held in this layout: from then on
// prefill-sized calls of that shape run on oneDNN over the tiles in place.
void set_onednn_md(int64_t n, int64_t k, const torch::Tensor& md) {
  TORCH_CHECK(md.scalar_type() == at::kByte && md.dim() == 1, "set_onednn_md: md [bytes] uint8");
  const torch::Tensor mc = md.contiguous();
  const uint8_t* p = mc.data_ptr<uint8_t>();
#ifdef LEVERLAB_AMX_BF16_TILES
  std::lock_guard<std::mutex> lock(g_md_mutex);
  g_md[{n, k}] = std::vector<uint8_t>(p, p + mc.numel());
#else
  (void)n, (void)k, (void)p;
#endif
}

// Rows `ids` [T] (int64) of a weight held in tile order -> [T, K]: the embedding lookup of a tied output head, whose
// table is that weight. Row n's pair r of step s is word n % 32 of the step's row r.
torch::Tensor tile_rows(const torch::Tensor& tiles, const torch::Tensor& ids) {
  check_tiles(tiles);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "tile_rows: ids [T] int64");
  const int64_t steps = tiles.size(1), K = steps * kDepth, Np = tiles.size(0) * kBlock, T = ids.size(0);
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < Np, "tile_rows: id ", id[t], " outside the table's ", Np, " rows");
  auto out = torch::empty({T, K}, tiles.options());
  auto src = reinterpret_cast<const uint32_t*>(tiles.data_ptr<at::BFloat16>());  // a word: one pair of K
  auto dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = id[t];
      const uint32_t* b = src + (n / kBlock) * steps * (kStepElems / 2) + n % kBlock;
      uint32_t* row = dst + t * (K / 2);
      for (int64_t s = 0; s < steps; ++s)
        for (int r = 0; r < 16; ++r) row[s * 16 + r] = b[s * (kStepElems / 2) + r * kBlock];
    }
  });
  return out;
}

// The op (leverlab_cpu::linear_bf16_tiles): x [..., K] bf16, tiles from amx_bf16_pack of a [n, K] weight, bias [n] or
// None -> [..., n] bf16.
torch::Tensor linear_bf16_tiles(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n,
                                const c10::optional<torch::Tensor>& bias) {
  check_tiles(tiles);
  TORCH_CHECK(amx_bf16_tiles_available(), "linear_bf16_tiles: no AMX-BF16 in this build or CPU, or LEVERLAB_NO_AMX=1");
  const int64_t K = tiles.size(1) * kDepth, Np = tiles.size(0) * kBlock;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) == K,
              "linear_bf16_tiles: x [..., ", K, "] bfloat16, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(n > Np - kBlock && n <= Np, "linear_bf16_tiles: n ", n, " does not match tiles of ", Np, " rows");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "linear_bf16_tiles: bias has ", has_bias ? bias->numel() : 0,
              " elements, not ", n);
  const torch::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y.view(out_shape);
#ifdef LEVERLAB_AMX_BF16_TILES
  if (M > kMaxDecodeRows) {
    if (!onednn_linear(x2, tiles, n, K, bias, y))
      gemm(x2, reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), K, bias, n, y);
    return y.view(out_shape);
  }
  at::Tensor b32;
  const float* bp = bias_f32(bias, b32);
  // x copied into aligned tiles (a tile row straddling two lines had cost 3x: amx_util.h), zero past M
  const int64_t Mp = M <= 16 ? 16 : 32;
  amx::tile_vector<uint16_t> xa(static_cast<size_t>(Mp * K));
  auto xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  pack_x(xp, x2.stride(0), M, Mp, K, xa.data());
  auto tp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // streamed stores write whole aligned lines: rows of a multiple of 32 outputs from an aligned start
  const bool stream = n % 32 == 0 && reinterpret_cast<uintptr_t>(yp) % 64 == 0;
  if (M <= 16)
    decode<1>(tp, Np, K, xa.data(), M, bp, n, yp, stream);
  else
    decode<2>(tp, Np, K, xa.data(), M, bp, n, yp, stream);
#else
  (void)bias;
#endif
  return y.view(out_shape);
}

TORCH_LIBRARY_FRAGMENT(leverlab_cpu, m) {
  m.def("linear_bf16_tiles(Tensor x, Tensor tiles, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(leverlab_cpu, CPU, m) {
  m.impl("linear_bf16_tiles", &linear_bf16_tiles);
}
