// One extension module for our CPU kernels (built by leverlab/kernels/cpu_kernels.py).
#include <torch/extension.h>

#include "stream_hint.h"
#include "vec_math.h"

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                        int64_t window, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale);
bool has_tiled_attention();
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
bool has_skinny_linear();
int64_t skinny_max_rows();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, bool quantize_x);
int64_t quant_max_rows();
bool has_int4_interleaved();
at::Tensor interleaved_to_rows(const at::Tensor& il);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias);
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group,
                       const c10::optional<at::Tensor>& bias);
bool has_fast_int6();
bool has_int6_stream();
void bind_fused_decoder(pybind11::module& m);
bool amx_int8_available();
at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale);
bool amx_bf16_enabled();
bool amx_attention_takes(int64_t D);
void amx_fresh_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out, double scale);
bool set_amx_bf16(bool on);
torch::Tensor amx_bf16_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
bool amx_bf16_tiles_available();
torch::Tensor amx_bf16_pack(const torch::Tensor& w);
torch::Tensor tile_rows(const torch::Tensor& tiles, const torch::Tensor& ids);
void set_onednn_md(int64_t n, int64_t k, const torch::Tensor& md);
at::Tensor bitmask_argmax(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);
at::Tensor apply_bitmask_(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask);

namespace {
int stream_family(const std::string& name) {  // -1: not a family
  return name == "bf16"   ? kStreamBf16
         : name == "int8" ? kStreamInt8
         : name == "int4" ? kStreamInt4
         : name == "int6" ? kStreamInt6
                          : -1;
}
int prefetch_kind(const std::string& name) {  // -1: not a kind
  return name == "off" ? kPrefetchOff : name == "nta" ? kPrefetchNonTemporal : name == "t0" ? kPrefetchAhead
       : name == "l2" ? kPrefetchL2 : -1;
}
std::string prefetch_name(int kind) {
  return kind == kPrefetchOff ? "off" : kind == kPrefetchNonTemporal ? "nta" : kind == kPrefetchL2 ? "l2" : "t0";
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slot_mapping"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("query_start_loc"),
        pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none(),
        "write the new K/V, then attention of short query spans (decode, verification) over the paged KV cache "
        "(bf16/fp16/fp32, or int8 with k_scale/v_scale [num_blocks, block_size, KVH] float32)");
  m.def("has_tiled_attention", &has_tiled_attention,
        "whether paged_decode takes long spans (prefill chunks) in register tiles (AVX2); else short spans only");
  m.def("skinny_linear", &skinny_linear, "y = x W^T (+ b) in bfloat16 for 1..skinny_max_rows() rows (AVX-512 BF16 or AVX2)");
  m.def("has_skinny_linear", &has_skinny_linear, "whether this build has the streaming bf16 linear (AVX-512 BF16 or AVX2)");
  m.def("skinny_max_rows", &skinny_max_rows, "the most activation rows the streaming bf16 linear takes (0: none)");
  m.def("int8_linear", &int8_linear, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"),
        pybind11::arg("bias"), pybind11::arg("quantize_x") = false,
        "y = (x W^T) * s (+ b) for int8 W [N, K], float32 s [N]; streaming for 1..quant_max_rows() rows; "
        "quantize_x: bf16/fp16 x quantized per 32-block for integer dot products");
  m.def("int4_linear", &int4_linear, "y = x W^T (+ b) for int4 W (packed [N, K/2], panels [N/16, K/g, 8g+64] or interleaved rows [N, K/256, 128], fp16 scales and zero points [N, 2, K/g]); streaming for 1..quant_max_rows() rows");
  m.def("has_int4_interleaved", &has_int4_interleaved,
        "whether int4_linear streams interleaved rows (quant/int4.py pack_int4_interleaved): AVX2 without AVX-512 VNNI");
  m.def("int4_interleaved_to_rows", &interleaved_to_rows,
        "interleaved rows [N, K/256, 128] (pack_int4_interleaved) in the row layout [N, K/2]");
  m.def("int6_linear", &int6_linear, "y = x W^T (+ b) for int6 W (packed [N, 3K/4]: int4's layout, then the "
        "high 2 bits; fp16 scales and zero points [N, 2, K/g]); streaming for 1..quant_max_rows() rows");
  m.def("has_fast_int6", &has_fast_int6, "whether int6_linear streams bf16/fp16 rows with integer dot products "
        "(AVX-512 VNNI); else it takes a plain float loop");
  m.def("has_int6_stream", &has_int6_stream, "whether int6_linear streams one bf16/fp16 row with integer dot "
        "products: AVX-512 VNNI (any group size), or AVX2 (groups of 64, the default)");
  m.def("amx_int8_available", &amx_int8_available,
        "whether amx_int8_linear runs here: built with AMX int8 (-march=native on such a CPU) and the OS grants tiles");
  m.def("amx_int8_linear", &amx_int8_linear, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("w_scale"),
        "y = (q(x) W^T) * s_x * s_w on AMX tiles for any number of rows: W int8 [Np, Kp] zero-padded "
        "(quant/int8_gemm.py pack_amx), float32 s_w [N]; x quantized per row, symmetric");
  m.def("amx_attention_takes", &amx_attention_takes, pybind11::arg("head_dim"),
        "whether amx_fresh_attention runs here for this head size (AMX-BF16 on, D a multiple of 32 up to 256)");
  m.def("amx_fresh_attention", &amx_fresh_attention, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("out"), pybind11::arg("scale"),
        "causal attention of a fresh bf16 prompt on AMX tiles: q [n, H, D], k and v [n, KVH, D] -> out [n, H, D]");
  m.def("amx_bf16_enabled", &amx_bf16_enabled,
        "whether linear_bf16 takes 1..32 bf16 rows on AMX tiles: built with AMX-BF16, the OS grants tiles, not "
        "switched off (LEVERLAB_NO_AMX=1, set_amx_bf16)");
  m.def("set_amx_bf16", &set_amx_bf16, pybind11::arg("on"),
        "switch the AMX bf16 path on or off (A/B runs in one process); returns whether it is on");
  m.def("amx_bf16_linear", &amx_bf16_linear, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"),
        "y = x W^T (+ b) in bfloat16 on AMX tiles for 1..32 rows, W [N, K] as stored, K a multiple of 32");
  m.def("amx_bf16_tiles_available", &amx_bf16_tiles_available,
        "whether bf16 layers can be held in tile order (amx_bf16_pack, op leverlab_cpu::linear_bf16_tiles) here");
  m.def("amx_bf16_pack", &amx_bf16_pack, pybind11::arg("w"),
        "w [N, K] bf16, K a multiple of 32 -> its tiles [ceil(N/32), K/32, 1024] (amx_bf16_tiles.cpp's layout)");
  m.def("set_onednn_md", &set_onednn_md, pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("md"),
        "the serialized oneDNN descriptor of a [n, k] bf16 weight in tile order: its prefill GEMMs then run on "
        "oneDNN over the tiles");
  m.def("tile_rows", &tile_rows, pybind11::arg("tiles"), pybind11::arg("ids"),
        "rows ids [T] int64 of a weight in tile order -> [T, K] (a tied output head's embedding lookup)");
  m.def("quant_max_rows", &quant_max_rows, "the most activation rows the streaming int8/int4 kernels take");
  m.def("set_stream_prefetch",
        [](const std::string& kind, const std::string& family) {
          const int mode = prefetch_kind(kind);
          TORCH_CHECK(mode >= 0, "set_stream_prefetch: 'off', 'nta', 't0' or 'l2', not '", kind, "'");
          const int f = stream_family(family);
          TORCH_CHECK(f >= 0 || family == "all", "set_stream_prefetch: family 'bf16', 'int8', 'int4', 'int6' or 'all', "
                      "not '",
                      family, "'");
          for (int i = 0; i < kStreamFamilies; ++i)
            if (f < 0 || f == i) stream_prefetch_mode(i) = mode;
        },
        pybind11::arg("kind"), pybind11::arg("family") = "all",
        "how the streaming kernels of one family ('bf16', 'int8', 'int4', 'int6'; 'all': every one) prefetch their weights: "
        "'off', 'nta' (non-temporal, 1 KB ahead) or 't0' (into every cache level, 4 KB ahead); csrc/stream_hint.h");
  m.def("stream_prefetch",
        [](const std::string& family) {
          const int f = stream_family(family);
          TORCH_CHECK(f >= 0, "stream_prefetch: family 'bf16', 'int8', 'int4' or 'int6', not '", family, "'");
          return prefetch_name(stream_prefetch_mode(f));
        },
        pybind11::arg("family") = "bf16", "the prefetch kind one family's streaming kernels issue");
  m.def("argmax_first",
        [](const at::Tensor& x) {
          TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                      "argmax_first: a contiguous float32 vector");
          return argmax_first(x.data_ptr<float>(), x.numel());
        },
        "the index of the first maximum (NaNs never taken): the fused step's greedy choice over the logits");
  m.def("bitmask_argmax", &bitmask_argmax, pybind11::arg("logits"), pybind11::arg("rows"), pybind11::arg("bitmask"),
        "per listed row of float32 logits, the first maximum among the tokens its int32 bitmask allows (-1: "
        "none above -inf); the logits are not changed");
  m.def("apply_bitmask_", &apply_bitmask_, pybind11::arg("logits"), pybind11::arg("rows"), pybind11::arg("bitmask"),
        "in place: each listed row's float32 logits -inf outside its int32 bitmask; returns the allowed counts");
  bind_fused_decoder(m);
}
