"""A GGUF file's tensors as our checkpoint tensors: names mapped to Hugging Face's, llama.cpp's Q/K row order undone,
and each projection handed over in the form its quantization method takes (loader.py copies them in).

What each GGUF tensor type becomes (docs/quantization.md, "GGUF files"):
  F32 / F16 / BF16   as they are (into the model dtype, as a safetensors checkpoint's tensors)
  Q4_0               our int4 at groups of 32, bit for bit (quant/gguf.py): d * (q - 8) is int4's (q - z) * s
                     with z = 8 and the same fp16 scale; no float round trip
  Q8_0               our int8: the int8 kernels keep one scale per output row, Q8_0 one per 32 weights, so each
                     row is dequantized (exact in float32) and requantized per row, one more rounding of at most
                     half a step of the row's scale; said at load
  anything else      (K-quants, IQ, Q4_1, Q5_*...) dequantized to float32 by the gguf package (gguf.quants) and
                     then treated as a float tensor; said at load. In a Q4_0 file that is the tied embedding /
                     output head, which llama-quantize writes as Q6_K.
A projection that is not of its file's main type (a Q4_0 file's fallback rows) is quantized to that method from
its float32 values, and said. Which method a file gets: quant_method below.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from leverlab.errors import UnsupportedLever
from leverlab.models import gguf_file
from leverlab.models.config import ModelConfig
from leverlab.quant.gguf import GGUFQ4Method
from leverlab.quant.int8 import Int8Method
from leverlab.quant.layouts import GGUF_BLOCK, quantize_int4, quantize_int8, unpack_q4_0, unpack_q8_0
from leverlab.quant.registry import get_quant_method
from leverlab.quant_config import QUANT_METHODS, check_quantization

log = logging.getLogger("leverlab")

FLOAT_TYPES = ("F32", "F16", "BF16")
# llama.cpp's per-layer tensor names -> Hugging Face's (under model.layers.N.)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
SKIPPED = ("rope_freqs.weight",)  # Llama 3's RoPE divisors: read into the config (gguf_file.py)


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    elif base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name} has no place in our decoder")


def projection_types(path: str | Path) -> Counter:
    """How many decoder projections the file holds in each tensor type."""
    return Counter(t.tensor_type.name for t in gguf_file.reader(path).tensors
                   if t.name.startswith("blk.") and t.name.split(".")[2] in PROJECTIONS and t.name.endswith("weight"))


def quant_method(path: str | Path, requested: str | None):
    """The method for the file's projections. Mostly Q4_0: int4 at groups of 32 (GGUFQ4Method); mostly Q8_0: int8
    read as a checkpoint (requantized per row); float or other types: --quantization's method, quantizing the
    float (or dequantized) weights at load, or none. A --quantization of the file's own family keeps the file's
    values (its kernel-path options apply; the file's group size wins); another one requantizes, said at load."""
    requested = check_quantization(requested)
    types = projection_types(path)
    if not types:
        raise ValueError(f"GGUF {path} holds no decoder projections (blk.N.attn_q.weight, ...)")
    main = types.most_common(1)[0][0]
    options = QUANT_METHODS[requested][2] if requested else {}
    family = requested.split("-")[0].split("+")[0] if requested else None
    if main == "Q4_0" and family in (None, "int4"):
        method = GGUFQ4Method()
    elif main == "Q8_0" and family in (None, "int8"):
        method = Int8Method(checkpoint=True,
                            **{k: v for k, v in options.items() if k not in ("group_size", "quantize_lm_head")})
    else:
        if requested in ("awq", "gptq"):
            raise UnsupportedLever(f"--quantization {requested} reads {requested.upper()} checkpoints; this is a "
                                   f"GGUF file ({main}): drop the flag, or name int8 / int4 to requantize it")
        if main not in FLOAT_TYPES:
            what = f"requantized to {requested}" if requested else "served in the model dtype"
            log.warning("GGUF %s: its projections are %s, which no kernel of ours reads as they are: dequantized "
                        "by the gguf package and %s%s", Path(path).name, main, what,
                        "" if requested else " (pass --quantization int8 or int4 to requantize them)")
        return get_quant_method(requested)
    method.quantize_lm_head = bool(options.get("quantize_lm_head", False))
    if requested and main == "Q4_0" and requested != "int4" and options.get("group_size") not in (None, GGUF_BLOCK):
        log.info("GGUF %s: Q4_0 keeps its groups of %d (--quantization %s asked for %s)", Path(path).name,
                 GGUF_BLOCK, requested, options["group_size"])
    return method


def tensors(path: str | Path, cfg: ModelConfig, method, head_method=None,
            only: tuple[str, ...] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs for loader.py: a projection in the form `method` loads (GGUFQ4Method:
    qweight / scales / qzeros; Int8Method from a checkpoint: qweight / scales; otherwise a float weight), every
    other tensor as a float one. `head_method`: the output head's, when it is `method` itself (--lm-head-quantization
    same), so that an untied output.weight goes the projections' way. `only`: just these checkpoint names."""
    r = gguf_file.reader(path)
    done: Counter = Counter()
    for t in r.tensors:
        if t.name in SKIPPED:
            continue
        name, kind = hf_name(t.name), t.tensor_type.name
        if only is not None and name not in only:
            continue
        raw = np.asarray(t.data)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else t.name.split(".")[0]
        if cfg.architecture == "LlamaForCausalLM" and part in ("attn_q", "attn_k"):
            raw = raw[_unpermute_rows(cfg, part)]  # rows are whole in every GGUF type: permute them as stored
        head_too = part == "output" and head_method is not None and head_method is method
        is_proj = (part in PROJECTIONS or head_too) and name.endswith(".weight")
        prefix = name.rpartition(".")[0]
        if is_proj and isinstance(method, GGUFQ4Method):
            if kind == "Q4_0":
                q, s, z = unpack_q4_0(torch.from_numpy(raw.copy()))
                done["Q4_0 -> int4 (groups of 32), exact"] += 1
            else:
                q, s, z = quantize_int4(_float32(raw, t), GGUF_BLOCK)
                done[f"{kind} -> int4 (groups of 32), requantized from float32"] += 1
            yield from ((f"{prefix}.qweight", q), (f"{prefix}.scales", s), (f"{prefix}.qzeros", z))
        elif is_proj and isinstance(method, Int8Method) and method.checkpoint:
            if kind == "Q8_0":
                q8, d = unpack_q8_0(torch.from_numpy(raw.copy()))
                w = (q8.float().view(q8.shape[0], -1, GGUF_BLOCK) * d[..., None]).view(q8.shape)
                done["Q8_0 -> int8, requantized per output row (one scale per row, not per 32)"] += 1
            else:
                w = _float32(raw, t)
                done[f"{kind} -> int8, quantized per output row from float32"] += 1
            q, scales = quantize_int8(w)
            yield from ((f"{prefix}.qweight", q), (f"{prefix}.scales", scales))
        else:
            if kind not in FLOAT_TYPES:
                done[f"{kind} -> dequantized to float32 by gguf.quants (then the model dtype)"] += 1
            yield name, _float(raw, t)
    for what, n in sorted(done.items()):
        log.info("GGUF %s: %d tensor(s) %s", Path(path).name, n, what)


def _unpermute_rows(cfg: ModelConfig, part: str) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K permutation for llama-arch models. Its converter stores each
    head's rows as (pair j, half t) - rotate-half's two halves interleaved, for ggml's adjacent-pairs RoPE - where
    Hugging Face keeps (half t, pair j): HF row h*D + t*D/2 + j is GGUF row h*D + 2j + t."""
    heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
    d = cfg.head_dim
    return np.arange(heads * d).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)


def _float(raw: np.ndarray, t) -> torch.Tensor:
    """A tensor as stored when it is a float type (F32, F16, BF16 keep their dtype), else dequantized to
    float32. Shape [out, in] (ggml lists dims innermost first)."""
    kind = t.tensor_type.name
    if kind == "F32":
        return torch.from_numpy(np.array(raw, dtype=np.float32))
    if kind == "F16":
        return torch.from_numpy(np.array(raw, dtype=np.float16))
    if kind == "BF16":  # the reader gives its bytes: [..., 2 * in] uint8
        b = torch.from_numpy(np.array(raw, dtype=np.uint8))
        return b.view(torch.bfloat16).reshape(*raw.shape[:-1], raw.shape[-1] // 2)
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, t.tensor_type), dtype=np.float32))


def _float32(raw: np.ndarray, t) -> torch.Tensor:
    return _float(raw, t).float()
