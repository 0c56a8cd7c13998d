"""The fused decode path: the whole decoder forward of a short step (decode, verification) in one C++ call.

A decode step of a small model is bound by dispatch, not by its weights: module by module from Python it
pays about a hundred op calls and their Python frames, each a few microseconds, against about a millisecond of
weight reads for the bundled 15M model. `FusedDecoder` (kernels/csrc/fused_decoder.cpp) runs the same layers in
one native loop, as llama.cpp does, over the model's own tensors (no copy of any weight).

It serves steps whose sequences each have at most MAX_SPAN new tokens, on the CPU, at one tensor-parallel rank
with a float or int8 KV cache; with EAGLE it also returns the feature layers' outputs, as the module forward does.
Where the attention kernel tiles long spans (AVX2 and up: has_tiled_attention) it serves prefill chunks too: there
the module path's elementwise ops (RMS norms, rotary, SiLU, residual adds), each a separate pass over [T, H] or
[T, I] in float32 and back, cost about as much as the GEMMs on the bundled model, and a third of a 1,024-token
prefill of the Qwen3-0.6B shape on one thread; the C++ loops do each in one pass over rows still in cache.
A mixture-of-experts model's sparse layers run their whole MLP block in the same call (router, hit experts,
shared expert: MoeExperts.block, the op fused_moe() builds, which must run first), for steps of at most the tokens
that op takes. Everything else (quantization methods it does not know, tensor parallelism, an fp8 KV cache) keeps
the module path; `fused_decoder()` says why not.
Numerics follow the module path op for op (the fused tests compare the two in float32, token for token).
"""

from __future__ import annotations

import logging

import torch

from leverlab import env
from leverlab.kernels import cpu_kernels
from leverlab.layers.attention import KERNEL_MAX_SPAN, AttentionMetadata
from leverlab.models.decoder import CausalLM
from leverlab.models.moe import SparseMoE
from leverlab.quant import autotune, int8_gemm

log = logging.getLogger("leverlab")

# Longest span per sequence the fused path takes: the attention kernel's limit.
MAX_SPAN = KERNEL_MAX_SPAN


def _linear(layer) -> tuple[int, list]:
    """(kind, [weight, scale, bias]) for the C++ side (QuantMethod.fused_weights): 0 float, 1 int8 weight-only,
    2 int4, 3 int8 with bf16/fp16 activations quantized per 32-block, 5 bf16 in AMX tile order (bf16_linear.to_tiles)."""
    method = layer.quant_method
    if method is None:
        return (5 if layer.kernel_state.tiles else 0), [layer.weight, None, layer.bias]
    weights = method.fused_weights(layer)
    if weights is None:
        raise _NotFused(f"quantization method {method.name!r} has no fused kernel for this layer")
    return weights


class _NotFused(Exception):
    pass


def fused_decoder(model: CausalLM, kv_caches: list[torch.Tensor], kv_cache_dtype: str, tp_size: int,
                  kv_scales: list[torch.Tensor] | None = None):
    """A FusedForward over `model` and its KV caches (int8 ones with their scales), or None (the reason is
    logged)."""
    try:
        return _build(model, kv_caches, kv_cache_dtype, tp_size, kv_scales)
    except _NotFused as e:
        log.info("fused decode path off: %s", e)
        return None


def _build(model: CausalLM, kv_caches, kv_cache_dtype: str, tp_size: int, kv_scales):
    if env.flag("LEVERLAB_NO_FUSED_DECODE"):
        raise _NotFused("LEVERLAB_NO_FUSED_DECODE=1")
    if model.lm_head.weight.device.type != "cpu":
        raise _NotFused("not on the CPU")
    if tp_size > 1:
        raise _NotFused("tensor parallelism")
    if kv_cache_dtype not in ("auto", "int8"):  # fp8 has no AVX2 decode: its rows are dequantized by gathering
        raise _NotFused(f"a {kv_cache_dtype} KV cache")
    kern = cpu_kernels.kernels()
    if kern is None:
        raise _NotFused("the C++ kernels are not built here")
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype  # the C++ side runs every float tensor in this one dtype
    moe_rows = _sparse_rows(model, dtype) if cfg.is_moe else None
    layers, kinds, windows = [], [], []
    quantized = []  # (layer index, linear index in the C++ order, layer) of every quantized linear
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   attn.q_norm.weight if attn.q_norm is not None else None,
                   attn.k_norm.weight if attn.k_norm is not None else None]
        if any(t is not None and t.dtype != dtype for t in tensors) or model.model.norm.weight.dtype != dtype:
            raise _NotFused("norm weights in another dtype than the model's")
        sparse = isinstance(mlp, SparseMoE)  # its MLP block is its MoeExperts op (set_moe below)
        lins = (attn.qkv_proj, attn.o_proj) if sparse else (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for j, lin in enumerate(lins):
            if lin.quant_method is not None:
                quantized.append((i, j, lin))
            kind, ts = _linear(lin)
            if kind == 0 and ts[0].dtype != dtype:
                raise _NotFused("weights in mixed float dtypes")
            kinds.append(kind)
            tensors += ts
        if sparse:  # no dense gate_up / down
            kinds += [0, 0]
            tensors += [None] * 6
        layers.append([t.data if t is not None else None for t in tensors])
        windows.append(attn.window)
    rotary = model.model.layers[0].self_attn.rotary
    norm = model.model.norm
    dec = kern.FusedDecoder(model.model.embed_tokens.weight.data, norm.weight.data, rotary.cos, rotary.sin,
                            layers, kinds, windows, list(kv_caches), cfg.num_heads, cfg.num_kv_heads,
                            cfg.head_dim, float(norm.eps), float(model.model.layers[0].self_attn.scale),
                            list(model.aux_layers))
    if kv_cache_dtype == "int8":
        dec.set_kv_scales(list(kv_scales))
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoE):
            dec.set_moe(i, layer.mlp.kernel)
    head_rows = _set_head(dec, model, dtype)
    rows = _set_batched(dec, quantized, len(model.model.layers)) if quantized else None
    if moe_rows is not None:
        rows = moe_rows if rows is None else min(rows, moe_rows)
    span = None if kern.has_tiled_attention() else MAX_SPAN
    sparse = [(layer.mlp, layer.mlp.kernel) for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    return FusedForward(dec, max_tokens=rows, head_rows=head_rows, max_span=span, sparse=sparse)


def _sparse_rows(model: CausalLM, dtype: torch.dtype) -> int:
    """The most tokens a fused step of this MoE model may have: those every sparse layer's op (fused_moe, run before)
    takes with its experts' kernels as their modules pick them, and its shared expert's likewise."""
    rows = MOE_MAX_TOKENS
    for layer in model.model.layers:
        moe = layer.mlp
        if not isinstance(moe, SparseMoE):
            continue
        if moe.kernel is None:
            raise _NotFused("a sparse MoE layer without its C++ experts op (fused_moe did not take it)")
        if moe.gate.weight.dtype != dtype or (moe.shared_expert_gate is not None
                                              and moe.shared_expert_gate.weight.dtype != dtype):
            raise _NotFused("a router or shared expert gate in another dtype than the model's")
        rows = min(rows, moe.kernel_rows)
        if moe.shared_expert is not None:  # its quantized linears without the int8 GEMM past the rows they stream
            for lin in (moe.shared_expert.gate_up_proj, moe.shared_expert.down_proj):
                if lin.quant_method is not None and not autotune.eligible(lin):
                    rows = min(rows, lin.kernel_state.stream_rows)
    return rows


def _set_batched(dec, quantized: list, num_layers: int) -> int | None:
    """Give each quantized linear that has fbgemm's int8 GEMM beside its streaming kernel (quant/autotune.py:
    eligible) that GEMM past the rows it streams, as the module path runs it; returns the most rows the fused
    step takes (None: any). With every quantized linear covered, a step of any size keeps this path: at 16 rows
    the module path's Python cost ~1 ms per decoder layer (autotune.module_cost_per_layer_s), a quarter of an
    int4 step of the Qwen3-0.6B shape. Otherwise, past the rows where streaming every layer stops paying (measured
    at load), the module path takes the step, each layer at its faster kernel."""
    uncovered = _give_batched(dec, quantized)
    return autotune.fused_rows([lin for _, _, lin in quantized], num_layers) if uncovered else None


def _give_batched(dec, quantized: list) -> list:
    """dec.set_batched / set_batched_amx(i, j, ...) for each (i, j, linear) of `quantized` that autotune.eligible
    covers; returns the linears it does not cover."""
    uncovered = []
    for i, j, lin in quantized:
        if autotune.eligible(lin):
            w = int8_gemm.packed(lin.kernel_state.int8_key)
            if isinstance(w, int8_gemm.AmxWeight):
                dec.set_batched_amx(i, j, w.packed, w.scales, lin.kernel_state.stream_rows)
            else:
                dec.set_batched(i, j, w, lin.kernel_state.stream_rows, int8_gemm.REDUCE_RANGE)
        else:
            uncovered.append(lin)
    return uncovered


def _set_head(dec, model: CausalLM, dtype: torch.dtype) -> int:
    """Give the C++ side the output head, so that a step's logits come out of the same call; returns the most
    rows it takes there (0: none; the head stays in CausalLM.compute_logits). A quantized head with the int8 GEMM
    beside its streaming kernel (autotune.eligible) takes any rows, each count on the kernel the module path would
    use; one without it its streaming rows only (more go to the module path's kernel, whose numerics differ)."""
    head = model.lm_head
    if head.bias is not None:
        return 0
    if head.quant_method is None:
        if head.weight.dtype != dtype:
            return 0
        dec.set_head(5 if head.kernel_state.tiles else 0, head.weight.data, None)
        return 1 << 30  # any number: compute_logits' own op (linear_bf16, or linear_bf16_tiles), whatever the rows
    weights = head.quant_method.fused_weights(head)
    if weights is None:
        return 0
    kind, (w, scale, _) = weights
    dec.set_head(kind, w, scale)
    if not autotune.eligible(head):
        return head.kernel_state.stream_rows
    # Past its streaming rows (a decode batch of 16 at int8), the head's GEMM in the same call, not the module path
    # after it: an int8 step of 16 sequences of the 0.6B shape, one thread, alternating processes, 92.4 / 92.3 ->
    # 86.1 / 86.9 ms.
    packed = int8_gemm.packed(head.kernel_state.int8_key)
    if isinstance(packed, int8_gemm.AmxWeight):
        dec.set_head_batched_amx(packed.packed, packed.scales, head.kernel_state.stream_rows)
    else:
        dec.set_head_batched(packed, head.kernel_state.stream_rows, int8_gemm.REDUCE_RANGE)
    return 1 << 30


# The most tokens of a step whose routed experts run in one C++ call (fused_moe): decode batches and short
# verification spans, where the Python frames per hit expert weigh against its weight reads; the streaming kernels
# take up to 32 rows.
MOE_MAX_TOKENS = 32
# Up to this many rows per hit expert a step's experts are shared out among the threads whole (MoeExperts
# set_expert_split): at decode most hit experts have one row or two.
EXPERT_SPLIT_ROWS = 4


def fused_moe(model: CausalLM) -> int:
    """Give each sparse MoE layer of `model` its routed experts as one C++ op (SparseMoE.kernel: MoeExperts in
    csrc/fused_decoder.cpp), over each expert's linears as _linear() describes them; returns how many layers took
    it (0: the reason is logged). Each quantized expert linear gets fbgemm's int8 GEMM past the rows it streams as
    the fused decoder's do (_give_batched), so that each expert picks its kernel by its own rows as its module does;
    a layer with a linear not so covered takes the op only for steps of at most the rows that linear streams."""
    if not model.config.is_moe:
        return 0
    try:
        if env.flag("LEVERLAB_NO_FUSED_MOE"):
            raise _NotFused("LEVERLAB_NO_FUSED_MOE=1")
        if model.lm_head.weight.device.type != "cpu":
            raise _NotFused("not on the CPU")
        kern = cpu_kernels.kernels()
        if kern is None:
            raise _NotFused("the C++ kernels are not built here")
        moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
        built = []
        for moe in moes:
            tensors, kinds, quantized = [], [], []
            for e, expert in enumerate(moe.experts):
                ts, ks = _expert(expert, e, quantized)
                tensors.append(ts)
                kinds += ks
            op = kern.MoeExperts(tensors, kinds)
            gate = moe.gate
            op.set_router(gate.weight.data, gate.top_k, gate.renormalize, gate.float32_weights)
            shared = []  # the shared expert's quantized linears: not the routed op's (its rows stay the experts')
            if moe.shared_expert is not None:
                ts, ks = _expert(moe.shared_expert, len(moe.experts), shared)
                op.set_shared(ts, ks, moe.shared_expert_gate.weight.data)
                _give_batched(op, shared)
            op.set_expert_split(EXPERT_SPLIT_ROWS)
            uncovered = _give_batched(op, quantized)
            rows = min([MOE_MAX_TOKENS] + [lin.kernel_state.stream_rows for lin in uncovered])
            built.append((moe, op, rows))
    except _NotFused as e:
        log.info("fused MoE experts off: %s", e)
        return 0
    for moe, op, rows in built:
        moe.kernel, moe.kernel_rows = op, rows
    return len(built)


def _expert(mlp, e: int, quantized: list) -> tuple[list, list[int]]:
    """(6 tensors, 2 kinds) of one expert's gated MLP for MoeExperts; appends (e, j, linear) to `quantized` for each
    quantized linear."""
    ts, kinds = [], []
    for j, lin in enumerate((mlp.gate_up_proj, mlp.down_proj)):
        kind, t = _linear(lin)
        if lin.quant_method is not None:
            quantized.append((e, j, lin))
        kinds.append(kind)
        ts += t
    return [t.data if t is not None else None for t in ts], kinds


class FusedForward:
    def __init__(self, dec, max_tokens: int | None, head_rows: int = 0, max_span: int | None = MAX_SPAN,
                 sparse: list | None = None):
        # max_span: the most new tokens of one sequence a step may bring (None: any, prefill chunks included)
        self.dec, self.max_tokens, self.head_rows, self.max_span = dec, max_tokens, head_rows, max_span
        self.sparse = sparse or []  # (SparseMoE, its MoeExperts op) per sparse layer

    def record_hits(self, reads) -> None:
        """Hand the last step's distinct experts per sparse layer to the expert-read counters (models/expert_reads.py
        ExpertReads): the step routed in C++, where the routers' Python hooks do not see it."""
        for moe, op in self.sparse:
            reads.record_hits(moe, op.last_hits())

    def takes(self, max_query_len: int, num_tokens: int) -> bool:
        """Whether this step is short enough for the fused path."""
        return (self.max_span is None or max_query_len <= self.max_span) and (
            self.max_tokens is None or num_tokens <= self.max_tokens)

    def takes_head(self, rows: int) -> bool:
        """Whether step() can compute the logits of this many rows."""
        return rows <= self.head_rows

    def step(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
             seq_lens: list[int], starts: list[int], rows: list[int]):
        """The whole step from plain lists: (hidden [T, H], aux [T, A * H] or None, float32 logits [R, V] of
        `rows`, their argmax as a list)."""
        return self.dec.step(ids, positions, slots, tables, seq_lens, starts, rows)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """ids, positions [T] -> the final normed hidden states [T, H] (with EAGLE's aux layers, the pair
        (hidden, aux [T, A * H])), as CausalLM.forward returns them."""
        out = self.dec.forward(ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc)
        return out[0] if len(out) == 1 else tuple(out)
