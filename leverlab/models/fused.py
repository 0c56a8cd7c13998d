"""The fused decode path: the whole decoder forward of a short step (decode, verification) in one C++ call.

A decode step of a small model is bound by dispatch, not by its weights: module by module from Python it
pays about a hundred op calls and their Python frames, each a few microseconds, against about a millisecond of
weight reads for the bundled 15M model. `FusedDecoder` (layers/csrc/fused_decoder.cpp) runs the same layers in
one native loop, as llama.cpp does, over the model's own tensors (no copy of any weight).

It serves steps whose sequences each have at most MAX_SPAN new tokens, on the CPU, for the plain decoder at one
tensor-parallel rank with a float KV cache. Everything else (prefill chunks, quantization methods it does not
know, EAGLE's feature layers, tensor parallelism) keeps the module path; `fused_decoder()` says why not.
Numerics follow the module path op for op (the fused tests compare the two in float32, token for token).
"""

from __future__ import annotations

import logging

import torch

from leverlab import env
from leverlab.layers import cpu_kernels
from leverlab.layers.attention import KERNEL_MAX_SPAN, AttentionMetadata
from leverlab.models.decoder import CausalLM

log = logging.getLogger("leverlab")

# Longest span per sequence the fused path takes: the attention kernel's limit.
MAX_SPAN = KERNEL_MAX_SPAN


def _linear(layer) -> tuple[int, list]:
    """(kind, [weight, scale, bias]) for the C++ side: 0 float weight, 1 int8 weight + per-row scale."""
    method = layer.quant_method
    if method is None:
        return 0, [layer.weight, None, layer.bias]
    fused = getattr(method, "fused_weights", None)
    if fused is None:
        raise _NotFused(f"quantization method {method.name!r} has no fused kernel")
    return fused(layer)


class _NotFused(Exception):
    pass


def fused_decoder(model: CausalLM, kv_caches: list[torch.Tensor], kv_cache_dtype: str, tp_size: int):
    """A FusedDecoder over `model` and its KV caches, or None (the reason is logged at debug level)."""
    try:
        return _build(model, kv_caches, kv_cache_dtype, tp_size)
    except _NotFused as e:
        log.info("fused decode path off: %s", e)
        return None


def _build(model: CausalLM, kv_caches, kv_cache_dtype: str, tp_size: int):
    if env.flag("LEVERLAB_NO_FUSED_DECODE"):
        raise _NotFused("LEVERLAB_NO_FUSED_DECODE=1")
    if model.lm_head.weight.device.type != "cpu":
        raise _NotFused("not on the CPU")
    if tp_size > 1 or model.aux_layers or kv_cache_dtype != "auto":
        raise _NotFused("tensor parallelism, EAGLE feature layers or a quantized KV cache")
    kern = cpu_kernels.kernels()
    if kern is None:
        raise _NotFused("the C++ kernels are not built here")
    cfg = model.config
    layers, kinds, windows = [], [], []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   attn.q_norm.weight if attn.q_norm is not None else None,
                   attn.k_norm.weight if attn.k_norm is not None else None]
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            kind, ts = _linear(lin)
            kinds.append(kind)
            tensors += ts
        dtype = model.model.embed_tokens.weight.dtype
        if any(t is not None and t.is_floating_point() and t.dtype != dtype and t.dim() > 1 for t in tensors):
            raise _NotFused("weights in mixed float dtypes")
        layers.append([t.data if t is not None else None for t in tensors])
        windows.append(attn.window)
    rotary = model.model.layers[0].self_attn.rotary
    norm = model.model.norm
    return kern.FusedDecoder(model.model.embed_tokens.weight.data, norm.weight.data, rotary.cos, rotary.sin,
                             layers, kinds, windows, list(kv_caches), cfg.num_heads, cfg.num_kv_heads,
                             cfg.head_dim, float(norm.eps), float(model.model.layers[0].self_attn.scale))


def run(fused, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """ids, positions [T] -> the final normed hidden states [T, H], exactly as CausalLM.forward returns them."""
    return fused.forward(ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
