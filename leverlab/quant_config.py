"""The quantization flags' values and their checks: plain data, so that EngineConfig validates --quantization,
--lm-head-quantization and --kv-cache-dtype without importing the methods (quant/registry.py builds them).

Adding a method is adding a file under quant/ with a `QuantMethod` subclass and one line in QUANT_METHODS.
"""

from __future__ import annotations

from leverlab.errors import UnsupportedLever

# flag value -> (module, class, constructor options)
QUANT_METHODS: dict[str, tuple[str, str, dict]] = {
    "int8": ("leverlab.quant.int8", "Int8Method", {}),
    "int8-woq": ("leverlab.quant.int8", "Int8Method", {"w8a8_min_rows": 9}),  # weight-only up to 8 rows
    "int4": ("leverlab.quant.int4", "Int4Method", {"group_size": 64}),
    "int4-g32": ("leverlab.quant.int4", "Int4Method", {"group_size": 32}),
    "int4-g64": ("leverlab.quant.int4", "Int4Method", {"group_size": 64}),
    "int4-g128": ("leverlab.quant.int4", "Int4Method", {"group_size": 128}),
    "int6": ("leverlab.quant.int6", "Int6Method", {"group_size": 64}),  # 6.5 bits: an int4 model's head by default
    # The output head in the method's own kernel (plain int8/int4 put it in int8: --lm-head-quantization).
    "int8+head": ("leverlab.quant.int8", "Int8Method", {"quantize_lm_head": True}),
    "int4+head": ("leverlab.quant.int4", "Int4Method", {"group_size": 64, "quantize_lm_head": True}),
    "awq": ("leverlab.quant.awq", "AWQMethod", {}),
    "gptq": ("leverlab.quant.gptq", "GPTQMethod", {}),
    "fp8": ("leverlab.quant.fp8", "FP8Method", {}),
    # llm-compressor's format (W8A8 int8, W4A16 int4, FP8): each config group onto our int8/int4/fp8 kernels
    "compressed-tensors": ("leverlab.quant.compressed_tensors", "CompressedTensorsMethod", {}),
}
# Methods whose weights must come pre-quantized in the checkpoint (their config lives there).
CHECKPOINT_ONLY = ("awq", "gptq", "compressed-tensors")

# --lm-head-quantization values. The tied head of a small model is a large share of a step's bytes (a fifth of the
# bundled model, a quarter of Qwen3-0.6B), and llama.cpp's Q4_0 files keep it above 4 bits: Q6_K where rows are a
# multiple of 256 long, else Q8_0. "auto": int8 for the int8 methods; int6 for the int4 methods where the int6
# kernel streams (bf16/fp16 on a CPU with AVX-512 VNNI or AVX2, a hidden size that is a multiple of 128: quant/int6.py),
# else int8; the model dtype otherwise (fp8; AWQ/GPTQ checkpoints, whose own heads vLLM keeps as they are).
# "none": the model dtype; "int8", "int6": that whatever the method; "same": the method's own kernel (int4+head).
LM_HEAD_QUANTIZATION = ("auto", "none", "int8", "int6", "same")

# --kv-cache-dtype values; "auto" keeps the model dtype. fp8 is e4m3 (vLLM's "fp8" means the same).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


def check_quantization(name: str | None) -> str | None:
    """Normalize a --quantization value (None / "none" -> None); unknown names list the valid ones."""
    if name is None or name == "none":
        return None
    if name not in QUANT_METHODS:
        raise UnsupportedLever(f"unknown --quantization {name!r}; valid: none, {', '.join(QUANT_METHODS)}")
    return name


def check_lm_head_quantization(name: str) -> str:
    if name not in LM_HEAD_QUANTIZATION:
        raise UnsupportedLever(f"unknown --lm-head-quantization {name!r}; valid: {', '.join(LM_HEAD_QUANTIZATION)}")
    return name


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise UnsupportedLever(f"unknown --kv-cache-dtype {name!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
    return name
