// The whole decoder forward for short steps (decode, speculative verification) in one C++ call.
//
// Why: a decode step of a small model reads a few MB of weights, about a millisecond, while the same forward
// run module by module from Python pays ~100 op dispatches (norms, rotary, residuals, the linears and the
// attention of every layer), each a few microseconds plus its Python frames: measured on the bundled 15M model,
// the dispatch took longer than the weights. This is what llama.cpp does: one native loop over the layers.
// Each linear is our streaming kernel (bf16, up to 32 rows) or aten's; attention is paged_decode(), which also
// writes the new K/V; the elementwise work between them runs in plain loops on the step's few rows.
//
// Numerics follow the module path (models/decoder.py) op for op: every elementwise op rounds to the model dtype
// as torch's eager op does (RMS norm in float32, then the cast, then the weight), so in float32 the two paths
// run the same arithmetic, and the linears are the very same calls.
//
// Shapes: T rows (the step's new tokens, sequence after sequence), H hidden, NH query heads, NKV KV heads, D
// head size, I intermediate size.
#include <torch/extension.h>
#include <torch/csrc/jit/api/object.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_int8.h"
#include "vec_math.h"

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                        int64_t window, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);

class MoeExperts;

namespace {

// Where a step's time goes (scripts/profile_step.py): wall time per phase, summed over the layers and the steps,
// taken only while switched on (FusedDecoder.set_phase_timing), so that otherwise a phase costs one untaken branch.
// Why built in: three rounds of work each added such timers by hand to find where an int4 step's time went, then
// removed them. Phases, in a step's order: norms (the step's input tensors and embedding lookup, every RMS norm,
// EAGLE's feature copies), qkv, rope (q/k norms and rotary), attention (paged_decode, with the new K/V's write), o
// (with its residual add), gate_up, act (SiLU times up), down (with its residual add), moe (a sparse layer's whole
// MLP block: router, experts, shared expert, with its residual add), head (the output head's logits and their
// argmax).
enum Phase : int { kNorms, kQkv, kRope, kAttention, kO, kGateUp, kAct, kDown, kMoe, kHead, kPhases };
constexpr const char* kPhaseNames[kPhases] = {"norms", "qkv", "rope", "attention", "o", "gate_up", "act", "down",
                                              "moe", "head"};

class PhaseClock {
 public:
  explicit PhaseClock(double* ns) : ns_(ns), t_(ns != nullptr ? now() : 0) {}
  // The time since the last lap (or the start) goes to phase p.
  void lap(Phase p) {
    if (ns_ == nullptr) return;
    const int64_t n = now();
    ns_[p] += static_cast<double>(n - t_);
    t_ = n;
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  double* ns_;  // null: not timing
  int64_t t_;
};

// A linear layer as the fused path sees it (the kernels are in quant_linear.cpp). kind 0: float weight [N, K];
// 1: int8 weight [N, K] with a float32 scale per output row, weight-only (3: the same with bf16/fp16 activations
// quantized per 32-block for integer dot products); 2: int4 packed [N, K/2] with fp16 scales and zero points
// (`scale`, [N, 2, K/g]); 4: int6 packed [N, 3K/4] with the same scales (an int4 model's output head); 5: bf16 in
// AMX tile order, [N/32, K/32, 1024] (amx_bf16_tiles.cpp).
// A quantized layer may also have fbgemm's int8 x int8 GEMM (quant/int8_gemm.py) for more rows than it streams
// (`stream_rows`, measured at load: quant/autotune.py): `packed` is its prepacked weight, called through the
// dispatcher as the module path calls it, so that batches past the streaming kernels' crossover stay on this path.
// On CPUs with AMX the int8 copy is in AMX tiles instead (`amx_w`, `amx_scale`: amx_int8.cpp), called directly.
struct Lin {
  int64_t kind = 0;
  at::Tensor w, scale, bias;  // bias may be undefined
  c10::IValue packed;  // None: no fbgemm kernel
  at::Tensor amx_w, amx_scale;  // undefined: no AMX kernel
  int64_t stream_rows = 0;
  bool reduce_range = false;
};

struct Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // [H], [H], [D], [D] (q/k norms undefined without them)
  Lin qkv, o, gate_up, down;  // gate_up, down: unset in a sparse layer
  std::shared_ptr<MoeExperts> moe;  // a sparse MoE layer's MLP block (FusedDecoder.set_moe); null: dense
  int64_t window = 0;  // > 0: sliding-window attention
  at::Tensor k_cache, v_cache;  // this layer's KV cache, [num_blocks, block_size, NKV, D] each
  c10::optional<at::Tensor> k_scale, v_scale;  // an int8 cache's scales (set_kv_scales), else none
};

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool quantize_x);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias);
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias);
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale);
torch::Tensor linear_bf16_tiles(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n,
                                const c10::optional<torch::Tensor>& bias);
torch::Tensor tile_rows(const torch::Tensor& tiles, const torch::Tensor& ids);

namespace {

// The batched int8 GEMM, op for op as quant/int8_gemm.py's int8_linear and the quant methods' apply (bias added in
// the activations' dtype): our AMX kernel where the weight is packed for it, else fbgemm's dynamic-quantization
// linear (each row divided by its own max|x| first, the result scaled back).
at::Tensor batched(const Lin& l, const at::Tensor& x) {
  if (l.amx_w.defined()) {
    at::Tensor y = amx_int8_linear(x, l.amx_w, l.amx_scale);
    return l.bias.defined() ? y + l.bias : y;
  }
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor r = xf.abs().amax({1}, true).clamp_min(1e-12);
  torch::jit::Stack stack{c10::IValue(xf / r), l.packed, c10::IValue(l.reduce_range)};
  op.callBoxed(&stack);
  at::Tensor y = (stack[0].toTensor() * r).to(x.scalar_type());
  return l.bias.defined() ? y + l.bias : y;
}

// Past stream_rows rows the linear takes fbgemm's int8 GEMM (`packed`), or the same in AMX tiles (`amx_w`).
void set_lin_batched(Lin& lin, const torch::jit::Object& packed, int64_t stream_rows, bool reduce_range) {
  lin.packed = c10::IValue(packed._ivalue());
  TORCH_CHECK(lin.packed.isObject(), "set_batched: a prepacked fbgemm weight (quantized::linear_prepack)");
  lin.stream_rows = stream_rows;
  lin.reduce_range = reduce_range;
}

void set_lin_batched_amx(Lin& lin, at::Tensor packed, at::Tensor scale, int64_t stream_rows) {
  lin.amx_w = packed;
  lin.amx_scale = scale;
  lin.stream_rows = stream_rows;
}

at::Tensor apply(const Lin& l, const at::Tensor& x) {
  if ((!l.packed.isNone() || l.amx_w.defined()) && x.size(0) > l.stream_rows) return batched(l, x);
  c10::optional<at::Tensor> b = l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt;
  if (l.kind == 1 || l.kind == 3) return int8_linear(x, l.w, l.scale, b, l.kind == 3);
  if (l.kind == 5) return linear_bf16_tiles(x, l.w, l.w.size(0) * 32, b);  // no padding: bf16_linear.tileable
  if (l.kind == 2 || l.kind == 4) {  // the group size: K / (number of groups)
    const int64_t group = x.size(1) / l.scale.size(2);
    return l.kind == 2 ? int4_linear(x, l.w, l.scale, group, b) : int6_linear(x, l.w, l.scale, group, b);
  }
  return linear_bf16(x, l.w, b);  // our streaming kernel for bf16 rows it takes, else the best GEMM here
}

// y = w * cast(x * rsqrt(mean(x^2) + eps)) over the last dim of n rows of `dim` elements, as RMSNorm.forward.
template <typename T>
void rms_norm_rows_scalar(const T* x, const T* w, T* y, int64_t n, int64_t dim, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * dim;
    float ss = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = static_cast<float>(xr[i]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    T* yr = y + r * dim;
    for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * static_cast<T>(static_cast<float>(xr[i]) * inv);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t n, int64_t dim, float eps) {
  rms_norm_rows_scalar<T>(x, w, y, n, dim, eps);
}

// Rotate-half rotary on one head's D values in place, with cos/sin rows (float32, cast to T as the module does).
template <typename T>
void rope_head_scalar(T* x, const float* cos, const float* sin, int64_t D, T* tmp) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) tmp[i] = x[i];
  for (int64_t i = 0; i < D; ++i) {
    const T rot = i < half ? static_cast<T>(-tmp[i + half]) : tmp[i - half];
    x[i] = tmp[i] * static_cast<T>(cos[i]) + rot * static_cast<T>(sin[i]);
  }
}

template <typename T>
void rope_head(T* x, const float* cos, const float* sin, int64_t D, T* tmp) {
  rope_head_scalar<T>(x, cos, sin, D, tmp);
}

#if defined(__AVX512BF16__)
// bf16 in registers: 16 values widened to float32, and float32 rounded to bf16 (nearest even, as c10's cast)
// and widened back, so that a vector op rounds where the scalar BFloat16 op does.
inline __m512 bf16x16_load(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i bf16x16_bits(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline __m512 bf16x16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_bits(v)), 16));
}
inline void bf16x16_store(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16_bits(v));
}

// A vector of bf16 values as float32 lanes, for the bf16 rope_head below: 16 lanes.
struct Bf16Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const c10::BFloat16* p) { return bf16x16_load(p); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static V round(V v) { return bf16x16_round(v); }
  static void store(c10::BFloat16* p, V v) { bf16x16_store(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define LEVERLAB_FUSED_BF16X8 1
// The same in 8 lanes for AVX2 (no bf16 instructions): float32 -> bf16 rounds to nearest even in integer ops, as
// c10's cast does (NaN to the quiet NaN). Scalar, the casts had cost a Zen 1 decode step 1.2 ms of rotary and 2.0
// of SiLU (0.6B shape, 2 threads, 2% and 4% of an int4 step).
inline __m256 bf16x8_load(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256i bf16x8_bits32(__m256 v) {  // bf16 bits in the low half of each 32-bit lane
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256 bf16x8_round(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_bits32(v), 16)); }
inline void bf16x8_store(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16x8_bits32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// ... and 8 lanes.
struct Bf16Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const c10::BFloat16* p) { return bf16x8_load(p); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static V round(V v) { return bf16x8_round(v); }
  static void store(c10::BFloat16* p, V v) { bf16x8_store(p, v); }
};
#endif

#if defined(__AVX512BF16__) || defined(LEVERLAB_FUSED_BF16X8)
// rope_head for bf16, a vector of lanes at a time with the scalar path's roundings (each product, then the sum): a
// decode step rotates (NH + NKV) heads in every layer while the other thread waits. One definition for both
// widths (Bf16Lanes), with GCC's vector operators: the same vmulps / vaddps / vsubps as the intrinsics.
template <>
void rope_head<c10::BFloat16>(c10::BFloat16* x, const float* cos, const float* sin, int64_t D,
                              c10::BFloat16* tmp) {
  using L = Bf16Lanes;
  using V = L::V;
  const int64_t half = D / 2;
  if (half % L::kWidth) return rope_head_scalar(x, cos, sin, D, tmp);
  for (int64_t i = 0; i < half; i += L::kWidth) {
    const V lo = L::load(x + i), hi = L::load(x + half + i);
    // cos/sin cast to bf16, as the scalar path does
    const V clo = L::round(L::loadf(cos + i)), chi = L::round(L::loadf(cos + half + i));
    const V slo = L::round(L::loadf(sin + i)), shi = L::round(L::loadf(sin + half + i));
    // x[i] = x[i] cos[i] - x[i + half] sin[i]; x[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half]
    const V neg_hi = V{} - hi;
    L::store(x + i, L::round(lo * clo) + L::round(neg_hi * slo));
    L::store(x + half + i, L::round(hi * chi) + L::round(lo * shi));
  }
}

// rms_norm_rows for bf16, a vector of lanes at a time, rounding where the scalar path does (x * inv to bf16, then
// the product with the weight, exact in float32, rounded by the store). The sum of squares runs in two vector
// accumulators, so its order differs from the scalar loop's (as torch's own reduction order does). On a Zen 1, one
// thread, hot: a 1,024-wide norm 2.2 us scalar (a chain of dependent float adds, c10's rounding per element), 1.2
// here; a 128-wide head norm 0.32 and 0.20. A 0.6B-shaped step runs 57 of the one and 672 of the other.
template <>
void rms_norm_rows<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t n,
                                  int64_t dim, float eps) {
  using L = Bf16Lanes;
  using V = L::V;
  if (dim % (2 * L::kWidth)) return rms_norm_rows_scalar(x, w, y, n, dim, eps);
  for (int64_t r = 0; r < n; ++r) {
    const c10::BFloat16* xr = x + r * dim;
    V s0{}, s1{};
    for (int64_t i = 0; i < dim; i += 2 * L::kWidth) {
      const V a = L::load(xr + i), b = L::load(xr + i + L::kWidth);
      s0 += a * a;
      s1 += b * b;
    }
    s0 += s1;
    float ss = 0.f;
    for (int j = 0; j < L::kWidth; ++j) ss += s0[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    const V iv = V{} + inv;
    c10::BFloat16* yr = y + r * dim;
    for (int64_t i = 0; i < dim; i += L::kWidth) L::store(yr + i, L::load(w + i) * L::round(L::load(xr + i) * iv));
  }
}
#endif

// One token's run of heads [h0, h1) in its qkv row (query heads first, then key heads: nq of them): the q/k RMS
// norm (qw / kw, or none when qw is null) then the rotary, as rms_norm_rows and rope_head one after the other.
template <typename T>
void norm_rope_heads_each(T* row, int64_t h0, int64_t h1, int64_t nq, const T* qw, const T* kw, const float* cos,
                          const float* sin, int64_t D, float eps, T* tmp) {
  for (int64_t hd = h0; hd < h1; ++hd) {
    T* head = row + hd * D;
    if (qw != nullptr) rms_norm_rows<T>(head, hd < nq ? qw : kw, head, 1, D, eps);
    rope_head<T>(head, cos, sin, D, tmp);
  }
}

template <typename T>
void norm_rope_heads(T* row, int64_t h0, int64_t h1, int64_t nq, const T* qw, const T* kw, const float* cos,
                     const float* sin, int64_t D, float eps, T* tmp) {
  norm_rope_heads_each<T>(row, h0, h1, nq, qw, kw, cos, sin, D, eps, tmp);
}

#if defined(__AVX512BF16__) || defined(LEVERLAB_FUSED_BF16X8)
// The same in bf16 with each head's D values in registers from load to store, and the token's cos / sin rounded
// to bf16 once for its run of heads: the two calls stored the normed head and loaded it back, and rounded the
// tables per head. Same roundings in the same order (the sum of squares in rms_norm_rows' two accumulators and
// lane order), so the same bits. The 0.6B shape's 1,024-token prefill on one thread (24 heads a token, D 128):
// this phase was ~2.5 ms a layer.
template <>
void norm_rope_heads<c10::BFloat16>(c10::BFloat16* row, int64_t h0, int64_t h1, int64_t nq,
                                    const c10::BFloat16* qw, const c10::BFloat16* kw, const float* cos,
                                    const float* sin, int64_t D, float eps, c10::BFloat16* tmp) {
  using L = Bf16Lanes;
  using V = L::V;
  constexpr int64_t W = L::kWidth, kMaxVecs = 256 / W;
  const int64_t half = D / 2, nv = D / W, hv = half / W;
  if (D % (2 * W) || D > 256)
    return norm_rope_heads_each<c10::BFloat16>(row, h0, h1, nq, qw, kw, cos, sin, D, eps, tmp);
  V cs[kMaxVecs], sn[kMaxVecs], v[kMaxVecs];
  for (int64_t i = 0; i < nv; ++i) {
    cs[i] = L::round(L::loadf(cos + i * W));
    sn[i] = L::round(L::loadf(sin + i * W));
  }
  for (int64_t hd = h0; hd < h1; ++hd) {
    c10::BFloat16* x = row + hd * D;
    for (int64_t i = 0; i < nv; ++i) v[i] = L::load(x + i * W);
    if (qw != nullptr) {
      V s0{}, s1{};
      for (int64_t i = 0; i < nv; i += 2) {
        s0 += v[i] * v[i];
        s1 += v[i + 1] * v[i + 1];
      }
      s0 += s1;
      float ss = 0.f;
      for (int j = 0; j < W; ++j) ss += s0[j];
      const V iv = V{} + 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      const c10::BFloat16* w = hd < nq ? qw : kw;
      for (int64_t i = 0; i < nv; ++i) v[i] = L::round(L::load(w + i * W) * L::round(v[i] * iv));
    }
    for (int64_t i = 0; i < hv; ++i) {
      const V lo = v[i], hi = v[hv + i];
      L::store(x + i * W, L::round(lo * cs[i]) + L::round((V{} - hi) * sn[i]));
      L::store(x + half + i * W, L::round(hi * cs[hv + i]) + L::round(lo * sn[hv + i]));
    }
  }
}
#endif

// out[i] = silu(gate[i]) rounded to T, times up[i], rounded to T (torch's silu then mul), for n elements.
template <typename T>
void silu_mul_span(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; i + 16 <= n; i += 16)
      bf16x16_store(out + i, _mm512_mul_ps(bf16x16_round(silu16(bf16x16_load(gate + i))), bf16x16_load(up + i)));
#endif
#if LEVERLAB_FUSED_BF16X8
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; i + 8 <= n; i += 8)
      bf16x8_store(out + i, _mm256_mul_ps(bf16x8_round(silu8(bf16x8_load(gate + i))), bf16x8_load(up + i)));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) out[j] = static_cast<T>(silu(static_cast<float>(gate[j]))) * up[j];
}

// Whether a prefill-sized step runs this linear through the grouped AMX int8 GEMM (amx_int8.h), its outputs
// consumed by the caller's epilogue while in L1: the batched AMX path would take it (past its streaming rows), it
// has no bias (added in T before anything else reads the outputs), and LEVERLAB_NO_GROUPED_GEMM is not 1.
bool grouped_gemm(const Lin& l, int64_t rows) {
  static const bool off = [] {
    const char* v = std::getenv("LEVERLAB_NO_GROUPED_GEMM");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return !off && l.amx_w.defined() && rows > l.stream_rows && !l.bias.defined();
}

// Weight rows group_step * g + block_step * j, for j < per_group and g < groups: the block_rows of amx_int8_grouped.
std::vector<int64_t> grouped_blocks(int64_t groups, int64_t per_group, int64_t group_step, int64_t block_step) {
  std::vector<int64_t> b;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t j = 0; j < per_group; ++j) b.push_back(group_step * g + block_step * j);
  return b;
}

}  // namespace

// A gated MLP's output for rows x, gate_up then down: with torch's own SiLU and product, as MLP.forward (not the
// dense fused step's SiLU loop, which differs in the last bit): float32 equals the module path exactly, and these
// are ~1/100 of an expert's weight reads.
at::Tensor gated_mlp(const std::array<Lin, 2>& l, const at::Tensor& x) {
  const at::Tensor gu = apply(l[0], x);
  const int64_t I = gu.size(1) / 2;
  return apply(l[1], at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I));
}

// The routed experts of one sparse MoE layer (models/moe.py SparseMoE) for decode-sized steps, in one call: what
// expert_outputs() does from Python, op for op, without its per-expert Python frames (Linear, quant method, MLP:
// about 30-60 us per hit expert, against ~0.3 ms of int8 weight reads for one expert of the Qwen3-30B-A3B shape).
// forward() takes the router's choices (the module path routes in torch: SparseMoE.kernel); block() is the whole
// sparse block, routing and Qwen2-MoE's shared expert included, for the fused decode step (FusedDecoder.set_moe).
// Each expert's two linears are Lins as the fused decoder holds a dense layer's (models/fused.py _linear), applied
// with the same kernels (streaming up to its stream_rows, fbgemm's or AMX's int8 GEMM past them: set_batched);
// the caller takes this path only for steps where every expert's linears pick their kernels as the modules do,
// so the result equals the module path's bit for bit.
class MoeExperts {
 public:
  // Per expert 6 tensors, (weight, scale, bias) of gate_up then down; kinds holds 2 per expert.
  MoeExperts(std::vector<std::vector<c10::optional<at::Tensor>>> experts, std::vector<int64_t> kinds) {
    TORCH_CHECK(kinds.size() == 2 * experts.size(), "MoeExperts: two kinds per expert");
    for (size_t e = 0; e < experts.size(); ++e)
      experts_.push_back(mlp_lins(experts[e], kinds[2 * e], kinds[2 * e + 1]));
  }

  // The router (Router in models/moe.py): its [E, H] weight in the model dtype, top k, renormalize (norm_topk_prob),
  // float32_weights (Mixtral: the weights scale the outputs in float32; else cast to the model dtype).
  void set_router(at::Tensor weight, int64_t top_k, bool renormalize, bool float32_weights) {
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == num_experts() && top_k >= 1 && top_k <= num_experts(),
                "MoeExperts.set_router: weight [E, H], 1 <= top_k <= E");
    router_ = weight;
    top_k_ = top_k;
    renormalize_ = renormalize;
    float32_weights_ = float32_weights;
  }

  // Qwen2-MoE's shared expert: 6 tensors and 2 kinds as an expert's, and its gate's [1, H] weight (a plain linear).
  void set_shared(std::vector<c10::optional<at::Tensor>> tensors, std::vector<int64_t> kinds, at::Tensor gate) {
    TORCH_CHECK(kinds.size() == 2 && gate.dim() == 2 && gate.size(0) == 1,
                "MoeExperts.set_shared: 2 kinds, gate [1, H]");
    shared_ = mlp_lins(tensors, kinds[0], kinds[1]);
    shared_gate_ = gate;
  }

  // At most this many rows per hit expert (0: never), the hit experts are shared out among the threads, each
  // expert's linears running whole on one thread, instead of every linear split across all threads: a decode step
  // of the Qwen3-30B-A3B shape hits 8 small experts per layer (1536 x 2048 and 2048 x 768), and a parallel region
  // per linear cost its fork, join and wait 16 times a layer.
  void set_expert_split(int64_t rows) { split_rows_ = rows; }

  // x [T, H], the router's weights [T, k] (model dtype or float32) and chosen experts [T, k] int64 -> the sum over
  // each token's experts of weight * expert(x) [T, H]. As expert_outputs(): the (token, slot) pairs sorted stably
  // by expert, each hit expert once over its rows in increasing expert order, the outputs scaled in the weights'
  // dtype, cast to the model's, and index_add_-ed into zeros (each token's contributions in increasing expert order).
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& weights, const at::Tensor& chosen_in) {
    TORCH_CHECK(x_in.dim() == 2 && chosen_in.dim() == 2 && weights.sizes() == chosen_in.sizes() &&
                    chosen_in.size(0) == x_in.size(0) && chosen_in.scalar_type() == at::kLong,
                "MoeExperts.forward: x [T, H], weights and chosen [T, k] (chosen int64)");
    const at::Tensor x = x_in.contiguous(), chosen = chosen_in.contiguous();
    const int64_t E = static_cast<int64_t>(experts_.size()), k = chosen.size(1), n = chosen.numel();
    const int64_t* c = chosen.data_ptr<int64_t>();
    std::vector<int64_t> count(E + 1, 0);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(c[i] >= 0 && c[i] < E, "MoeExperts.forward: expert ", c[i], " out of range");
      ++count[c[i] + 1];
    }
    last_hits_ = 0;
    if (n == 0) return at::zeros_like(x);
    for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];  // now each expert's first position in `order`
    at::Tensor order = at::empty({n}, chosen.options()), token = at::empty({n}, chosen.options());
    int64_t* o = order.data_ptr<int64_t>();
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t i = 0; i < n; ++i) o[next[c[i]]++] = i;  // a counting sort: stable, as argsort(stable=True)
    int64_t* tok = token.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) tok[i] = o[i] / k;
    const at::Tensor rows = x.index_select(0, token);  // [T * k, H], grouped by expert
    std::vector<int64_t> hit;
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e)
      if (count[e + 1] > count[e]) {
        hit.push_back(e);
        most = std::max(most, count[e + 1] - count[e]);
      }
    last_hits_ = static_cast<int64_t>(hit.size());
    std::vector<at::Tensor> ys(hit.size());
    auto run = [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t e = hit[i];
        ys[i] = gated_mlp(experts_[e], rows.narrow(0, count[e], count[e + 1] - count[e]));
      }
    };
    // Inside at::parallel_for each kernel's own split runs inline (at::in_parallel_region), so each thread streams
    // whole experts, taking the next one left as it finishes one (a thread whose memory stream runs slower for a
    // while does fewer); a row's value does not depend on which thread computes it (the kernels split by output
    // rows). Not in float32 with float experts: aten's GEMM there may sum differently by its threads.
    const bool aten_float = x.scalar_type() == at::kFloat && experts_[0][0].kind == 0;
    const int64_t nh = static_cast<int64_t>(hit.size()), threads = std::min<int64_t>(at::get_num_threads(), nh);
    if (most <= split_rows_ && threads > 1 && !aten_float) {
      std::atomic<int64_t> next{0};
      at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < nh;) run(i, i + 1);
      });
    } else {
      run(0, nh);
    }
    const at::Tensor y = (at::cat(ys) * weights.reshape({-1}).index_select(0, order).unsqueeze(1)).to(x.scalar_type());
    return at::zeros_like(x).index_add_(0, token, y);
  }

  // The whole sparse block on x [T, H] (SparseMoE.forward op for op): router logits in the model dtype, softmax in
  // float32, at::topk (torch.topk itself, so ties resolve as transformers' do: CPU topk is not lowest-index-first),
  // renormalized and cast as set_router says; forward(); plus sigmoid(gate(x)) * shared_expert(x) when set_shared.
  at::Tensor block(const at::Tensor& x) {
    TORCH_CHECK(router_.defined(), "MoeExperts.block: set_router first");
    const at::Tensor logits = at::linear(x, router_);
    auto [w, chosen] = at::topk(at::softmax(logits, -1, at::kFloat), top_k_, -1);
    if (renormalize_) w = w / w.sum(-1, true);
    if (!float32_weights_) w = w.to(logits.scalar_type());
    at::Tensor out = forward(x, w, chosen);
    if (shared_gate_.defined()) out = out + at::sigmoid(at::linear(x, shared_gate_)) * gated_mlp(shared_, x);
    return out;
  }

  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }

  // How many distinct experts the last forward() (or block()) ran: what the fused step hands to the expert-read
  // counters (models/expert_reads.py record_hits), its routing being out of Python's sight.
  int64_t last_hits() const { return last_hits_; }

  // Expert e's linear j (0 gate_up, 1 down; e = num_experts(): the shared expert's) takes fbgemm's GEMM past
  // stream_rows rows, as FusedDecoder's do: the module path switches per expert by its own rows, and so does this.
  void set_batched(int64_t e, int64_t j, const torch::jit::Object& packed, int64_t stream_rows, bool reduce_range) {
    set_lin_batched(linear(e, j), packed, stream_rows, reduce_range);
  }
  void set_batched_amx(int64_t e, int64_t j, at::Tensor packed, at::Tensor scale, int64_t stream_rows) {
    set_lin_batched_amx(linear(e, j), packed, scale, stream_rows);
  }

 private:
  static std::array<Lin, 2> mlp_lins(const std::vector<c10::optional<at::Tensor>>& t, int64_t k0, int64_t k1) {
    TORCH_CHECK(t.size() == 6, "MoeExperts: 6 tensors per expert");
    auto get = [](const c10::optional<at::Tensor>& v) { return v.has_value() ? *v : at::Tensor(); };
    std::array<Lin, 2> l;
    for (int j = 0; j < 2; ++j) {
      l[j].kind = j == 0 ? k0 : k1;
      l[j].w = get(t[3 * j]);
      l[j].scale = get(t[3 * j + 1]);
      l[j].bias = get(t[3 * j + 2]);
    }
    return l;
  }
  Lin& linear(int64_t e, int64_t j) {
    TORCH_CHECK(e >= 0 && e <= num_experts() && j >= 0 && j < 2 && (e < num_experts() || shared_gate_.defined()),
                "MoeExperts: expert (num_experts: the shared one, after set_shared), linear (0 gate_up, 1 down)");
    return e < num_experts() ? experts_[e][j] : shared_[j];
  }
  std::vector<std::array<Lin, 2>> experts_;  // gate_up, down
  at::Tensor router_;  // set_router: [E, H]
  int64_t top_k_ = 0;
  bool renormalize_ = false, float32_weights_ = false;
  std::array<Lin, 2> shared_;  // set_shared
  at::Tensor shared_gate_;  // [1, H]; undefined: no shared expert
  int64_t split_rows_ = 0;
  int64_t last_hits_ = 0;
};

class FusedDecoder {
 public:
  FusedDecoder(at::Tensor embed, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
               std::vector<std::vector<c10::optional<at::Tensor>>> layer_tensors, std::vector<int64_t> lin_kinds,
               std::vector<int64_t> windows, std::vector<at::Tensor> kv_caches, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, double scale, std::vector<int64_t> aux_layers)
      : embed_(embed), final_norm_(final_norm), cos_(cos.contiguous()), sin_(sin.contiguous()),
        kv_caches_(std::move(kv_caches)), aux_layers_(std::move(aux_layers)), nh_(num_heads), nkv_(num_kv_heads),
        d_(head_dim), eps_(eps), scale_(scale) {
    // Per layer, 16 entries: in_norm, post_norm, q_norm, k_norm, then (weight, scale, bias) for qkv, o, gate_up,
    // down; lin_kinds holds 4 kinds per layer.
    TORCH_CHECK(layer_tensors.size() == windows.size() && lin_kinds.size() == 4 * windows.size() &&
                    kv_caches_.size() == windows.size(), "FusedDecoder: one entry per layer");
    auto get = [](const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
    for (size_t i = 0; i < layer_tensors.size(); ++i) {
      const auto& t = layer_tensors[i];
      TORCH_CHECK(t.size() == 16, "FusedDecoder: 16 tensors per layer");
      Layer l;
      l.in_norm = get(t[0]);
      l.post_norm = get(t[1]);
      l.q_norm = get(t[2]);
      l.k_norm = get(t[3]);
      Lin* lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
      for (int j = 0; j < 4; ++j) {
        lins[j]->kind = lin_kinds[4 * i + j];
        lins[j]->w = get(t[4 + 3 * j]);
        lins[j]->scale = get(t[5 + 3 * j]);
        lins[j]->bias = get(t[6 + 3 * j]);
      }
      l.window = windows[i];
      if (kv_caches_[i].dim() > 0 && kv_caches_[i].size(0) == 2) {  // else no step runs (a probe's placeholder)
        l.k_cache = kv_caches_[i][0];  // views made once: a select per layer and step was ~1 us of dispatch each
        l.v_cache = kv_caches_[i][1];
      }
      layers_.push_back(std::move(l));
    }
  }

  // The output head for step(): kind as for the layers (0: float weight [V, H], the tied embedding included).
  void set_kv_scales(const std::vector<at::Tensor>& scales) {
    TORCH_CHECK(scales.size() == kv_caches_.size(), "set_kv_scales: one tensor per layer");
    for (size_t i = 0; i < scales.size(); ++i)
      TORCH_CHECK(kv_caches_[i].scalar_type() == at::kChar && scales[i].scalar_type() == at::kFloat,
                  "set_kv_scales: int8 caches, float32 scales (laid out as the cache: paged_decode checks)");
    for (size_t i = 0; i < scales.size(); ++i) {
      layers_[i].k_scale = scales[i][0];
      layers_[i].v_scale = scales[i][1];
    }
  }

  // Layer i's linear j (0 qkv, 1 o, 2 gate_up, 3 down); `who` names the caller in the error.
  Lin& linear(int64_t i, int64_t j, const char* who) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && j >= 0 && j < 4, who, ": layer, linear");
    Layer& l = layers_[i];
    Lin* lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    return *lins[j];
  }

  // Layer i's MLP block is sparse: `moe` (built by models/fused.py fused_moe, with its router) computes it, in
  // place of the dense gate_up / act / down.
  void set_moe(int64_t i, std::shared_ptr<MoeExperts> moe) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && moe, "set_moe: layer, MoeExperts");
    layers_[i].moe = std::move(moe);
  }

  // Layer i's linear j takes fbgemm's GEMM past stream_rows rows.
  void set_batched(int64_t i, int64_t j, const torch::jit::Object& packed, int64_t stream_rows, bool reduce_range) {
    set_lin_batched(linear(i, j, "set_batched"), packed, stream_rows, reduce_range);
  }

  // The same with the int8 copy in AMX tiles (quant/int8_gemm.py AmxWeight).
  void set_batched_amx(int64_t i, int64_t j, at::Tensor packed, at::Tensor scale, int64_t stream_rows) {
    set_lin_batched_amx(linear(i, j, "set_batched_amx"), packed, scale, stream_rows);
  }

  void set_head(int64_t kind, at::Tensor w, c10::optional<at::Tensor> scale) {
    head_.kind = kind;
    head_.w = w;
    head_.scale = scale.has_value() ? *scale : at::Tensor();
  }

  // The head's int8 GEMM past its streaming rows, as set_batched / set_batched_amx give a layer's: the module
  // path's kernel for those rows, so a step of any size takes its logits here with the same values.
  void set_head_batched(const torch::jit::Object& packed, int64_t stream_rows, bool reduce_range) {
    set_lin_batched(head_, packed, stream_rows, reduce_range);
  }
  void set_head_batched_amx(at::Tensor packed, at::Tensor scale, int64_t stream_rows) {
    set_lin_batched_amx(head_, packed, scale, stream_rows);
  }

  // A whole short step from plain lists, so that Python builds no tensors: the forward, then the head's logits for
  // `rows` (float32 [R, V], as CausalLM.compute_logits returns them) and each row's argmax (the first maximum, as
  // torch.argmax). tables: one block table per sequence (any lengths). Returns (hidden [T, H], aux or None,
  // logits, argmax).
  std::tuple<at::Tensor, c10::optional<at::Tensor>, at::Tensor, std::vector<int64_t>> step(
      const std::vector<int64_t>& ids, const std::vector<int64_t>& positions, const std::vector<int64_t>& slots,
      const std::vector<std::vector<int64_t>>& tables, const std::vector<int64_t>& seq_lens,
      const std::vector<int64_t>& qsl, const std::vector<int64_t>& rows) {
    TORCH_CHECK(head_.w.defined(), "FusedDecoder.step: set_head first");
    PhaseClock clock = start_clock();
    std::vector<at::Tensor> out =
        forward_timed(i64(ids), i64(positions), i64(slots), block_table(tables), i64(seq_lens), i64(qsl), clock);
    auto [logits, best] = head_rows(out[0], rows);
    clock.lap(kHead);
    c10::optional<at::Tensor> aux = out.size() > 1 ? c10::optional<at::Tensor>(out[1]) : c10::nullopt;
    return {out[0], aux, logits, best};
  }

  // EAGLE head mode: a FusedDecoder built over an EAGLE head's one layer (embed: the table its tokens are looked
  // up in; final_norm: the head's output norm; set_head: the head it drafts through). The layer's attention reads
  // concat(embed_norm(embedding), feature_norm(feature)) [T, 2H] and its residual stream starts from the feature
  // (normed first with norm_before_residual), as spec/eagle_head.py's forward.
  void set_eagle_input(at::Tensor embed_norm, at::Tensor feature_norm, bool norm_before_residual) {
    TORCH_CHECK(layers_.size() == 1 && aux_layers_.empty(), "set_eagle_input: a head has one layer, no aux layers");
    embed_norm_ = embed_norm;
    feature_norm_ = feature_norm;
    norm_before_residual_ = norm_before_residual;
  }

  // One head pass from plain lists and the rows' features [T, H]: returns (the head's hidden states [T, H] before
  // its output norm, the float32 logits of `rows` after it, their argmax).
  std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> head_step(
      const std::vector<int64_t>& ids, const at::Tensor& features, const std::vector<int64_t>& positions,
      const std::vector<int64_t>& slots, const std::vector<std::vector<int64_t>>& tables,
      const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& qsl, const std::vector<int64_t>& rows) {
    TORCH_CHECK(head_.w.defined() && embed_norm_.defined(), "FusedDecoder.head_step: set_head, set_eagle_input");
    TORCH_CHECK(features.dim() == 2 && features.size(0) == static_cast<int64_t>(ids.size()) &&
                    features.size(1) == hidden_size(), "head_step: features [T, H]");
    at::Tensor h, y;  // the head's hidden states, and after its output norm
    PhaseClock clock = start_clock();
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, embed_.scalar_type(), "fused_head", [&] {
      std::tie(h, y) = head_run<scalar_t>(i64(ids), features.to(embed_.scalar_type()).contiguous(), i64(positions),
                                          i64(slots), block_table(tables), i64(seq_lens), i64(qsl), clock);
    });
    auto [logits, best] = head_rows(y, rows);
    clock.lap(kHead);
    return {h, logits, best};
  }

  // ids, positions [T] int64 and the attention layout (as AttentionMetadata) -> [final normed hidden [T, H]], and
  // with aux layers (EAGLE's features) also their outputs concatenated [T, A * H], as CausalLM.forward returns.
  std::vector<at::Tensor> forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc) {
    PhaseClock clock = start_clock();
    return forward_timed(ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc, clock);
  }

  // Phase timing (PhaseClock) on or off; phase_times() returns {phase: seconds} summed since the last call (and
  // "steps": the calls timed: step, forward, head_step), then starts the sums again.
  void set_phase_timing(bool on) { timing_ = on; }
  // ("moe" only for a model with sparse layers.)
  std::vector<std::pair<std::string, double>> phase_times() {
    std::vector<std::pair<std::string, double>> out;
    const bool sparse = std::any_of(layers_.begin(), layers_.end(), [](const Layer& l) { return l.moe != nullptr; });
    for (int p = 0; p < kPhases; ++p)
      if (p != kMoe || sparse) out.emplace_back(kPhaseNames[p], phase_ns_[p] * 1e-9);
    out.emplace_back("steps", static_cast<double>(timed_steps_));
    phase_ns_.fill(0.0);
    timed_steps_ = 0;
    return out;
  }
  // The bytes of weights (and their scales) each linear phase reads per step: {phase: bytes}, the layers summed.
  std::vector<std::pair<std::string, double>> phase_bytes() const {
    auto bytes = [](const Lin& l) {  // int4/int6 panels carry their scales: the scale tensor is not read
      // (panels are 3-D, as are the interleaved rows, int4's [N, K / 256, 128] and int6's [.., 192], which read
      // their scales beside)
      const bool il = l.w.defined() && l.w.dim() == 3 && l.w.size(2) == (l.kind == 2 ? 128 : 192);
      const bool panels = (l.kind == 2 || l.kind == 4) && l.w.defined() && l.w.dim() == 3 && !il;
      double b = 0;
      for (const at::Tensor* t : {&l.w, &l.scale, &l.bias})
        if (t->defined() && !(panels && t == &l.scale)) b += static_cast<double>(t->nbytes());
      return b;
    };
    std::array<double, kPhases> b{};
    for (const Layer& l : layers_) {
      b[kQkv] += bytes(l.qkv);
      b[kO] += bytes(l.o);
      b[kGateUp] += bytes(l.gate_up);
      b[kDown] += bytes(l.down);
    }
    b[kHead] = bytes(head_);
    std::vector<std::pair<std::string, double>> out;
    for (Phase p : {kQkv, kO, kGateUp, kDown, kHead}) out.emplace_back(kPhaseNames[p], b[p]);
    return out;
  }

  // EAGLE's feature capture on or off between steps (off while speculation is gated off: nothing copied).
  void set_aux_layers(std::vector<int64_t> aux_layers) { aux_layers_ = std::move(aux_layers); }

 private:
  PhaseClock start_clock() {
    if (timing_) ++timed_steps_;
    return PhaseClock(timing_ ? phase_ns_.data() : nullptr);
  }

  std::vector<at::Tensor> forward_timed(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
                                        const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& qsl,
                                        PhaseClock& clock) {
    std::vector<at::Tensor> out;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, embed_.scalar_type(), "fused_decoder", [&] {
      out = run<scalar_t>(ids, positions, slots, tables, lens, qsl, clock);
    });
    return out;
  }

  static at::Tensor i64(const std::vector<int64_t>& v) { return at::tensor(at::ArrayRef<int64_t>(v), at::kLong); }

  static at::Tensor block_table(const std::vector<std::vector<int64_t>>& tables) {  // padded with block 0
    const int64_t B = static_cast<int64_t>(tables.size());
    int64_t width = 1;
    for (const auto& t : tables) width = std::max<int64_t>(width, static_cast<int64_t>(t.size()));
    at::Tensor bt = at::zeros({B, width}, at::kLong);
    for (int64_t b = 0; b < B; ++b) std::copy(tables[b].begin(), tables[b].end(), bt.data_ptr<int64_t>() + b * width);
    return bt;
  }

  // The head's float32 logits for `rows` of the normed hidden states [T, H], and each row's argmax (the first
  // maximum, as torch.argmax).
  std::pair<at::Tensor, std::vector<int64_t>> head_rows(const at::Tensor& hidden, const std::vector<int64_t>& rows) {
    const int64_t T_ = hidden.size(0);
    bool all_rows = static_cast<int64_t>(rows.size()) == T_;
    for (int64_t r = 0; all_rows && r < T_; ++r) all_rows = rows[r] == r;
    at::Tensor logits = at::empty({0, 0}, hidden.options().dtype(at::kFloat));
    std::vector<int64_t> best(rows.size());
    if (!rows.empty()) {
      logits = apply(head_, all_rows ? hidden : hidden.index_select(0, i64(rows))).to(at::kFloat);
      const int64_t V = logits.size(1);
      for (size_t r = 0; r < rows.size(); ++r) best[r] = argmax_first(logits.data_ptr<float>() + r * V, V);
    }
    return {logits, best};
  }

  // -> (the head's hidden states [T, H], the same after its output norm)
  template <typename T>
  std::pair<at::Tensor, at::Tensor> head_run(const at::Tensor& ids, const at::Tensor& f, const at::Tensor& positions,
                                             const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
                                             const at::Tensor& qsl, PhaseClock& clock) {
    const int64_t T_ = ids.size(0), H = hidden_size();
    const float eps = static_cast<float>(eps_);
    check_positions(positions);
    at::Tensor e = embed_rows(ids), ne = at::empty_like(e), nf = at::empty_like(f);
    rms_norm_rows<T>(e.data_ptr<T>(), embed_norm_.data_ptr<T>(), ne.data_ptr<T>(), T_, H, eps);
    rms_norm_rows<T>(f.data_ptr<T>(), feature_norm_.data_ptr<T>(), nf.data_ptr<T>(), T_, H, eps);
    at::Tensor x = norm_before_residual_ ? nf.clone() : f.clone();  // the residual stream
    at::Tensor y = at::empty_like(x);  // the MLP norm's buffer, then the output norm's
    clock.lap(kNorms);
    layer<T>(layers_[0], x, at::cat({ne, nf}, 1), y, positions, slots, tables, lens, qsl, clock);
    rms_norm_rows<T>(x.data_ptr<T>(), final_norm_.data_ptr<T>(), y.data_ptr<T>(), T_, H, eps);
    clock.lap(kNorms);
    return {x, y};
  }

  template <typename T>
  std::vector<at::Tensor> run(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
                              const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& qsl,
                              PhaseClock& clock) {
    const int64_t T_ = ids.size(0), H = hidden_size();
    const float eps = static_cast<float>(eps_);
    check_positions(positions);
    at::Tensor x = embed_rows(ids);  // [T, H] residual stream
    at::Tensor h = at::empty_like(x);
    at::Tensor aux;  // the aux layers' outputs (the residual stream after each), side by side
    if (!aux_layers_.empty()) aux = at::empty({T_, static_cast<int64_t>(aux_layers_.size()) * H}, x.options());
    for (const Layer& l : layers_) {
      rms_norm_rows<T>(x.data_ptr<T>(), l.in_norm.data_ptr<T>(), h.data_ptr<T>(), T_, H, eps);
      clock.lap(kNorms);
      layer<T>(l, x, h, h, positions, slots, tables, lens, qsl, clock);
      const int64_t li = &l - layers_.data();
      for (size_t j = 0; j < aux_layers_.size(); ++j)
        if (aux_layers_[j] == li) aux.narrow(1, static_cast<int64_t>(j) * H, H).copy_(x);
    }
    at::Tensor y = at::empty_like(x);
    rms_norm_rows<T>(x.data_ptr<T>(), final_norm_.data_ptr<T>(), y.data_ptr<T>(), T_, H, eps);
    clock.lap(kNorms);
    if (aux.defined()) return {y, aux};
    return {y};
  }


  void check_positions(const at::Tensor& positions) const {
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t t = 0, n = positions.size(0); t < n; ++t)
      TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "position out of range");
  }

  // One decoder layer on the residual stream x [T, H], in place, given its attention input h [T, Hin] (the
  // normed stream for a target layer; an EAGLE head's concatenated norms, Hin = 2H). hm [T, H]: the buffer the MLP
  // block's norm is written to (a target layer's h again): the caller's, so that a step allocates it once, not per
  // layer.
  template <typename T>
  void layer(const Layer& l, at::Tensor& x, const at::Tensor& h, at::Tensor& hm,
             const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
             const at::Tensor& qsl, PhaseClock& clock) {
    const int64_t T_ = x.size(0), H = x.size(1), D = d_, QW = nh_ * D, KW = nkv_ * D;
    const float eps = static_cast<float>(eps_);
    const int64_t* pos = positions.data_ptr<int64_t>();
    // ---- attention block
    at::Tensor qkv = apply(l.qkv, h);  // [T, QW + 2 KW]
    clock.lap(kQkv);
    T* qp = qkv.data_ptr<T>();
    const int64_t row = QW + 2 * KW, heads = nh_ + nkv_;
    // Each row's query heads, then its key heads, split between the threads: one token's 24 heads of the 0.6B
    // shape are ~12 us of work (a q/k norm and the rotary each), which one thread did while the other waited.
    const T* qw = l.q_norm.defined() ? l.q_norm.data_ptr<T>() : nullptr;
    const T* kw = l.q_norm.defined() ? l.k_norm.data_ptr<T>() : nullptr;
    at::parallel_for(0, T_ * heads, 4, [&](int64_t i0, int64_t i1) {
      static thread_local std::vector<T> tmp;  // rope_head's scratch (the scalar path's), kept between steps
      tmp.resize(D);
      for (int64_t i = i0; i < i1;) {  // a run of one token's heads at a time
        const int64_t t = i / heads, h0 = i % heads, h1 = std::min(heads, h0 + i1 - i);
        norm_rope_heads<T>(qp + t * row, h0, h1, nh_, qw, kw, cos_.data_ptr<float>() + pos[t] * D,
                           sin_.data_ptr<float>() + pos[t] * D, D, eps, tmp.data());
        i += h1 - h0;
      }
    });
    clock.lap(kRope);
    at::Tensor q = qkv.narrow(1, 0, QW).view({T_, nh_, D});
    at::Tensor k = qkv.narrow(1, QW, KW).view({T_, nkv_, D});
    at::Tensor v = qkv.narrow(1, QW + KW, KW).view({T_, nkv_, D});
    TORCH_CHECK(l.k_cache.defined(), "FusedDecoder: a layer's KV cache is [2, num_blocks, block_size, NKV, D]");
    at::Tensor o = paged_decode(q, k, v, l.k_cache, l.v_cache, slots, tables, lens, qsl, scale_, l.window, l.k_scale,
                                l.v_scale);
    clock.lap(kAttention);
    add_into<T>(x, apply(l.o, o.view({T_, QW})));
    clock.lap(kO);
    // ---- MLP block
    rms_norm_rows<T>(x.data_ptr<T>(), l.post_norm.data_ptr<T>(), hm.data_ptr<T>(), T_, H, eps);
    clock.lap(kNorms);
    if (l.moe) {  // a sparse layer: x + SparseMoE(hm)
      add_into<T>(x, l.moe->block(hm));
      clock.lap(kMoe);
      return;
    }
    at::Tensor act;
    if (grouped_gemm(l.gate_up, T_) && l.gate_up.amx_scale.numel() % 64 == 0) {
      // 32 gate columns and their 32 up columns at a time, SiLU(gate) * up while they are in L1: the [T, 2 I]
      // output is never stored, nor read back. Same values as the two passes below. The 0.6B shape's cold
      // 1,024-token int8 prefill, one thread, alternating processes: gate_up + act 396 / 406 ms -> 286 / 279 (of
      // ~1,250). The same done for the qkv's q/k norm and rotary, and o's and down's residual adds, gained nothing
      // (their passes are bound by their arithmetic, not by reading the outputs back): not kept.
      const int64_t I = l.gate_up.amx_scale.numel() / 2;
      act = at::empty({T_, I}, x.options());
      T* a = act.data_ptr<T>();
      const AmxEpilogue<T> silu_out = [&](int64_t g, int64_t m0, int64_t rows, const T* out, int64_t ld) {
        for (int64_t r = 0; r < rows; ++r)
          silu_mul_span<T>(out + r * ld, out + r * ld + 32, a + (m0 + r) * I + 32 * g, 32);
      };
      amx_int8_grouped<T>(hm.data_ptr<T>(), T_, H, l.gate_up.amx_w, l.gate_up.amx_scale,
                          grouped_blocks(I / 32, 2, 32, I), 2, silu_out);
      clock.lap(kGateUp);
    } else {
      at::Tensor gu = apply(l.gate_up, hm);  // [T, 2 I]
      clock.lap(kGateUp);
      const int64_t I = gu.size(1) / 2;
      act = at::empty({T_, I}, x.options());
      const T* g = gu.data_ptr<T>();
      T* a = act.data_ptr<T>();
      // In spans of kActSpan elements of a row, split between the threads: a Zen 1 takes ~14 us for one token's
      // 3,072 (the 0.6B shape), its exp, division and two bf16 roundings a chain too long to overlap much.
      constexpr int64_t kActSpan = 256;
      const int64_t spans = (I + kActSpan - 1) / kActSpan;
      at::parallel_for(0, T_ * spans, 1, [&](int64_t s0, int64_t s1) {
        for (int64_t sp = s0; sp < s1; ++sp) {
          const int64_t t = sp / spans, i = sp % spans * kActSpan, e = std::min(I, i + kActSpan);
          silu_mul_span<T>(g + t * 2 * I + i, g + t * 2 * I + I + i, a + t * I + i, e - i);
        }
      });
    }
    clock.lap(kAct);
    add_into<T>(x, apply(l.down, act));
    clock.lap(kDown);
  }

  template <typename T>
  static void add_into(at::Tensor& x, const at::Tensor& y) {  // x = x + y, rounded to T (the residual)
    T* xp = x.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    int64_t i = 0;
    const int64_t n = x.numel();
#if defined(__AVX512BF16__) || defined(LEVERLAB_FUSED_BF16X8)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      for (; i + Bf16Lanes::kWidth <= n; i += Bf16Lanes::kWidth)
        Bf16Lanes::store(xp + i, Bf16Lanes::load(xp + i) + Bf16Lanes::load(yp + i));
#endif
    for (; i < n; ++i) xp[i] = xp[i] + yp[i];
  }

  // The embedding table, [V, H]; or, tied to an output head held in AMX tile order, that head's [V/32, H/32, 1024].
  int64_t hidden_size() const { return embed_.dim() == 3 ? embed_.size(1) * 32 : embed_.size(1); }
  at::Tensor embed_rows(const at::Tensor& ids) const {
    return embed_.dim() == 3 ? tile_rows(embed_, ids) : embed_.index_select(0, ids);
  }
  at::Tensor embed_, final_norm_, cos_, sin_;
  at::Tensor embed_norm_, feature_norm_;  // EAGLE head mode (set_eagle_input)
  bool norm_before_residual_ = false;
  Lin head_;  // set_head(); step() applies it
  std::vector<at::Tensor> kv_caches_;  // per layer [2, num_blocks, block_size, NKV, D]
  std::vector<int64_t> aux_layers_;  // layer indices whose outputs forward() also returns (EAGLE)
  std::vector<Layer> layers_;
  bool timing_ = false;  // set_phase_timing
  std::array<double, kPhases> phase_ns_{};  // per phase, summed (PhaseClock)
  int64_t timed_steps_ = 0;
  int64_t nh_, nkv_, d_;
  double eps_, scale_;
};

void bind_fused_decoder(pybind11::module& m) {
  pybind11::class_<MoeExperts, std::shared_ptr<MoeExperts>>(m, "MoeExperts")
      .def(pybind11::init<std::vector<std::vector<c10::optional<at::Tensor>>>, std::vector<int64_t>>())
      .def("forward", &MoeExperts::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "x [T, H], routing weights [T, k], chosen experts [T, k] int64 -> sum of weight * expert(x) [T, H]")
      .def("block", &MoeExperts::block, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "x [T, H] -> the sparse block's output [T, H]: routing, experts, shared expert (set_router first)")
      .def("set_router", &MoeExperts::set_router, "weight [E, H], top_k, renormalize, float32_weights")
      .def("set_shared", &MoeExperts::set_shared, "6 tensors, 2 kinds (as an expert's), gate weight [1, H]: "
           "Qwen2-MoE's shared expert")
      .def("set_expert_split", &MoeExperts::set_expert_split, "rows: at most this many rows per hit expert, the "
           "threads take whole experts (0: every linear split across the threads)")
      .def("set_batched", &MoeExperts::set_batched, "expert (num_experts: the shared one), linear (0 gate_up, "
           "1 down), fbgemm packed weight, stream_rows, reduce_range: as FusedDecoder.set_batched")
      .def("set_batched_amx", &MoeExperts::set_batched_amx, "expert, linear, AMX-packed int8 weight, float32 "
           "scales, stream_rows: as FusedDecoder.set_batched_amx")
      .def("last_hits", &MoeExperts::last_hits, "distinct experts the last forward / block ran")
      .def("num_experts", &MoeExperts::num_experts);
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          std::vector<std::vector<c10::optional<at::Tensor>>>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, double,
                          double, std::vector<int64_t>>())
      // The GIL is released for the forward: the server's event loop (another thread) writes the previous
      // step's tokens to their streams while this step computes, instead of waiting for it.
      .def("set_head", &FusedDecoder::set_head, "kind, weight, scale or None: the output head for step()")
      .def("set_head_batched", &FusedDecoder::set_head_batched, "fbgemm's packed int8 head, stream_rows, "
           "reduce_range: the head's GEMM past its streaming rows (as set_batched)")
      .def("set_head_batched_amx", &FusedDecoder::set_head_batched_amx, "AMX-packed int8 head, float32 scales, "
           "stream_rows (as set_batched_amx)")
      .def("set_moe", &FusedDecoder::set_moe, "layer, MoeExperts (with its router): that layer's MLP block")
      .def("set_batched", &FusedDecoder::set_batched,
           "layer, linear (0 qkv, 1 o, 2 gate_up, 3 down), fbgemm packed weight, stream_rows, reduce_range: past "
           "stream_rows rows that linear takes fbgemm's int8 GEMM")
      .def("set_batched_amx", &FusedDecoder::set_batched_amx,
           "layer, linear, AMX-packed int8 weight, float32 scales, stream_rows: as set_batched, on AMX tiles")
      .def("set_kv_scales", &FusedDecoder::set_kv_scales, "per layer [2, num_blocks, block_size, NKV] float32: "
           "the caches are int8 (--kv-cache-dtype int8)")
      .def("set_phase_timing", &FusedDecoder::set_phase_timing, "on/off: time each phase of the steps (PhaseClock)")
      .def("phase_times", &FusedDecoder::phase_times, "[(phase, seconds)] summed since the last call, + ('steps', n); "
           "then starts again")
      .def("phase_bytes", &FusedDecoder::phase_bytes, "[(linear phase, bytes of weights and scales it reads a step)]")
      .def("set_aux_layers", &FusedDecoder::set_aux_layers, "layer indices whose outputs the next steps return")
      .def("set_eagle_input", &FusedDecoder::set_eagle_input, "embed_norm, feature_norm, norm_before_residual: "
           "this decoder is an EAGLE head's one layer (head_step)")
      .def("head_step", &FusedDecoder::head_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "ids, features [T, H], positions, slots, block tables, seq_lens, query_start_loc, rows (lists but "
           "features) -> (hidden before the output norm [T, H], float32 logits of rows, their argmax)")
      .def("step", &FusedDecoder::step, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "ids, positions, slots, block tables, seq_lens, query_start_loc, rows (lists) -> (hidden, aux or None, "
           "float32 logits of rows, their argmax)")
      .def("forward", &FusedDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc -> [final normed hidden [T, H]] "
           "(+ the aux layers' outputs [T, A * H] when it has aux layers)");
}
