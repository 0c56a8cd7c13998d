"""Name -> quantization method, imported lazily (`--quantization` validates without loading kernels).

Adding a method is adding a file with a `QuantMethod` subclass and one line here.
"""

from __future__ import annotations

import importlib

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
}
# Methods whose weights must come pre-quantized in the checkpoint (their config lives there).
CHECKPOINT_ONLY = ("awq", "gptq")

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


def head_quant_method(method, choice: str = "auto", device=None, hidden: int | None = None,
                      dtype: str | None = None):
    """The method for the output head, given the model's method and --lm-head-quantization (None: model dtype).
    device, hidden, dtype: where the model loads, its hidden size (the head's rows) and dtype, for auto's int6."""
    choice = check_lm_head_quantization(choice)
    if choice == "none":
        return None
    if choice == "same" or (choice == "auto" and method is not None and method.quantize_lm_head):
        if method is None:
            raise UnsupportedLever("--lm-head-quantization same needs a --quantization method")
        return method
    if choice == "int6" or (choice == "auto" and method is not None and method.name == "int4"
                            and _fast_int6(device, hidden, dtype)):
        return get_quant_method("int6")
    if choice == "int8" or (method is not None and method.name in ("int8", "int4")):
        return get_quant_method("int8")
    return None


def _fast_int6(device, hidden: int | None, dtype: str | None) -> bool:
    """Whether an int6 head would stream here at its speed (else auto keeps int8, whose kernels run anywhere):
    bf16/fp16 activations (float32 takes a plain loop, and has no int8 copy for batched rows) on a CPU with the
    AVX-512 VNNI or AVX2 kernel (has_int6_stream; the head's groups are 64), rows in whole 128-weight quads."""
    import torch

    if device is None or torch.device(device).type != "cpu" or hidden is None or hidden % 128:
        return False
    if dtype not in ("bfloat16", "float16"):
        return False
    from leverlab.kernels import cpu_kernels

    kern = cpu_kernels.kernels()
    return kern is not None and kern.has_int6_stream()


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise UnsupportedLever(f"unknown --kv-cache-dtype {name!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
    return name


def _cls(name: str):
    module, cls, options = QUANT_METHODS[name]
    return getattr(importlib.import_module(module), cls), options


def get_quant_method(name: str | None):
    """A method for a flag value (None for none). awq/gptq need their checkpoint's config: see below."""
    name = check_quantization(name)
    if name is None:
        return None
    if name in CHECKPOINT_ONLY:
        raise UnsupportedLever(
            f"--quantization {name} loads pre-quantized {name.upper()} checkpoints only, and this one has no "
            f"quantization_config; quantize at load time with int8/int4 or write one with `leverlab quantize`"
        )
    cls, options = _cls(name)
    method = cls(**{k: v for k, v in options.items() if k != "quantize_lm_head"})
    method.quantize_lm_head = options.get("quantize_lm_head", False)
    return method


def quant_method_for_checkpoint(qcfg: dict, requested: str | None = None):
    """The method a pre-quantized checkpoint's `quantization_config` asks for. A --quantization flag that
    names a different method is refused rather than silently ignored."""
    kind = str(qcfg.get("quant_method", "")).lower()
    if kind not in QUANT_METHODS:
        raise UnsupportedLever(f"checkpoint quant_method {kind!r} is not supported; supported: "
                               f"{', '.join(m for m in QUANT_METHODS if '-g' not in m)}")
    requested = check_quantization(requested)
    # int4 names the same math as an AWQ/GPTQ checkpoint (whose own group size wins): accepted for them.
    same = {kind} | ({"int4"} if kind in CHECKPOINT_ONLY else set())
    if requested is not None and requested.split("-")[0] not in same:
        raise UnsupportedLever(f"--quantization {requested} does not match this checkpoint, which is "
                               f"pre-quantized with {kind}; drop the flag or pass --quantization {kind}")
    cls, _ = _cls(kind)
    method = cls.from_checkpoint_config(qcfg)
    if requested is not None:  # kernel-path options of the flag (int8-w8a8); the checkpoint's group size wins
        for key, value in QUANT_METHODS[requested][2].items():
            if key not in ("group_size", "quantize_lm_head"):
                setattr(method, key, value)
    return method
