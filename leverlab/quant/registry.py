"""Name -> quantization method, imported lazily (`--quantization` validates without loading kernels).

Adding a method is adding a file with a `QuantMethod` subclass and one line in quant_config.QUANT_METHODS (the
flag values and their checks live there, below config).
"""

from __future__ import annotations

import importlib

from leverlab.errors import UnsupportedLever
from leverlab.kernels import cpu_kernels
from leverlab.quant_config import (  # the flag values and their checks: plain data (config validates with them)
    CHECKPOINT_ONLY,
    QUANT_METHODS,
    check_lm_head_quantization,
    check_quantization,
)

# `leverlab quantize --method int4` writes AWQ's layout under quant_method "int4": such a checkpoint reads as AWQ.
CHECKPOINT_READERS = {"int4": "awq"}
# quant_method -> the class reading its checkpoints where that is not the flag's own (fp8 quantizes at load).
CHECKPOINT_CLASSES = {"fp8": ("leverlab.quant.fp8_checkpoint", "FP8CheckpointMethod")}


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
        if method.name == "compressed-tensors":  # a config, not a layer method: its head is ignored or refused
            raise UnsupportedLever("--lm-head-quantization same: this compressed-tensors checkpoint leaves the "
                                   "output head out of its groups; pick int8, int6 or none")
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
    kern = cpu_kernels.kernels()
    return kern is not None and kern.has_int6_stream()


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
    if kind in CHECKPOINT_CLASSES:
        module, name = CHECKPOINT_CLASSES[kind]
        cls = getattr(importlib.import_module(module), name)
    else:
        cls, _ = _cls(CHECKPOINT_READERS.get(kind, kind))
    if kind == "compressed-tensors":
        # Its groups say everything (activations included): only a flag naming what it holds is accepted.
        method = cls.from_checkpoint_config(qcfg)
        if requested not in (None, kind, *method.families):
            raise UnsupportedLever(f"--quantization {requested} does not match this checkpoint, which is "
                                   f"compressed-tensors {'/'.join(sorted(method.families))}; drop the flag or pass "
                                   f"--quantization {kind}")
        return method
    # int4 names the same math as an AWQ/GPTQ checkpoint (whose own group size wins): accepted for them.
    same = {kind} | ({"int4"} if kind in CHECKPOINT_ONLY else set())
    if requested is not None and requested.split("-")[0] not in same:
        raise UnsupportedLever(f"--quantization {requested} does not match this checkpoint, which is "
                               f"pre-quantized with {kind}; drop the flag or pass --quantization {kind}")
    method = cls.from_checkpoint_config(qcfg)
    if requested is not None:  # kernel-path options of the flag (int8-w8a8); the checkpoint's group size wins
        for key, value in QUANT_METHODS[requested][2].items():
            if key not in ("group_size", "quantize_lm_head"):
                setattr(method, key, value)
    return method
