"""The EAGLE head's pass in one C++ call: FusedDecoder (kernels/csrc/fused_decoder.cpp) in head mode.

Why: the head is one decoder layer, and run module by module from Python a pass paid ~40 op dispatches and
their frames: on the bundled model (8 target layers, 384 wide) 0.61 ms a pass against ~0.2 ms of weight reads,
three passes a step beside a 1.4 ms target step. In head mode the C++ loop takes the head's embedding lookup,
its two input norms, its layer (the target's layer code: the same kernels, paged_decode over the head's own
cache), its output norm and the drafting logits with their argmax, in one call.

It serves passes whose sequences each bring at most MAX_SPAN rows (drafting, and the catch-up after a
verification step); the catch-up over a whole prompt takes the module path, as the target's prefill does.
Numerics follow EagleHead.forward op for op (a test holds the two to the same drafts in float32).
"""

from __future__ import annotations

import logging

import torch

from leverlab.kernels import cpu_kernels
from leverlab.models.fused import MAX_SPAN, _linear, _NotFused

log = logging.getLogger("leverlab")


class FusedHead:
    """One head pass: (hidden before the output norm [T, H], float32 drafting logits of `rows`, their argmax)."""

    def __init__(self, dec):
        self.dec = dec

    @staticmethod
    def takes(spans) -> bool:
        return all(n <= MAX_SPAN for _, _, n in spans)

    def run(self, ids, features, positions, slots, tables, seq_lens, starts, rows):
        return self.dec.head_step(ids, features, positions, slots, tables, seq_lens, starts, rows)


def fused_head(head, embed: torch.Tensor, draft_head: torch.nn.Module, kv_cache: torch.Tensor) -> FusedHead | None:
    """A FusedHead over `head` (speculative/eagle_head.py), drafting through `draft_head` (a Linear: the target's
    lm_head, an int8 copy of it, or the head's own over its draft vocabulary), or None (the reason is logged)."""
    try:
        return _build(head, embed, draft_head, kv_cache)
    except _NotFused as e:
        log.info("EAGLE head: fused pass off (%s); module path", e)
        return None


def _build(head, embed, draft_head, kv_cache) -> FusedHead:
    kern = cpu_kernels.kernels()
    if kern is None:
        raise _NotFused("the C++ kernels are not built here")
    if embed.device.type != "cpu":
        raise _NotFused("not on the CPU")
    dtype = embed.dtype
    if draft_head.bias is not None:
        raise _NotFused("a drafting head with a bias")
    # The layer's four norm slots (in_norm, post_norm, q_norm, k_norm); head_step never reads in_norm (the
    # attention input is set_eagle_input's two norms), so the embedding's norm fills it.
    norms = [head.embed_norm.weight, head.post_attention_layernorm.weight,
             head.q_norm.weight if head.q_norm is not None else None,
             head.k_norm.weight if head.k_norm is not None else None]
    if any(t is not None and t.dtype != dtype for t in [*norms, head.feature_norm.weight, head.norm.weight]):
        raise _NotFused("norm weights in another dtype than the embedding's")
    tensors, kinds = list(norms), []
    for lin in (head.qkv_proj, head.o_proj, head.mlp.gate_up_proj, head.mlp.down_proj):
        kind, ts = _linear(lin)
        if kind == 0 and ts[0].dtype != dtype:
            raise _NotFused("weights in mixed float dtypes")
        kinds.append(kind)
        tensors += ts
    cfg = head.config
    dec = kern.FusedDecoder(embed, head.norm.weight.data, head.rotary.cos, head.rotary.sin,
                            [[t.data if t is not None else None for t in tensors]], kinds, [0], [kv_cache],
                            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.rms_norm_eps),
                            float(head.scale), [])
    dec.set_eagle_input(head.embed_norm.weight.data, head.feature_norm.weight.data, bool(cfg.norm_before_residual))
    kind, (w, scale, _) = _linear(draft_head)
    if kind == 0 and w.dtype != dtype:
        raise _NotFused("a drafting head in another dtype")
    dec.set_head(kind, w.data, scale)
    return FusedHead(dec)
