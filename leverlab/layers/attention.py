"""Attention over the paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A sequence owns a
list of blocks (its block table); token t of a sequence lives at slot block_table[t // bs] * bs + t % bs.
The engine stores each block head-major (quant/kv_cache.py allocate), so the cache tensors are transposed views:
this module indexes them and never flattens them; the C++ kernel reads either layout through the strides.

The kernel is registered as a torch custom op, so that a compiled model treats it as one opaque call:
Inductor compiles the projections and MLPs around it while the cache writes and the per-sequence
bookkeeping stay in plain eager PyTorch. The step's layout and the cache tensors reach the op through a
forward context set by the model runner around each forward, not as graph inputs: as inputs, their
changing shapes (batch size, block-table width) would make the compiled graph guard and recompile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leverlab.kernels import cpu_kernels
from leverlab.kernels.custom_op import custom_op
from leverlab.quant import kv_cache as kv_quant

# Steps whose sequences all have at most this many new tokens (decode: 1; verification: 1 + K) take the C++
# kernel, which loops over queries one at a time; steps with longer prefill chunks keep SDPA per sequence.
KERNEL_MAX_SPAN = 16


@dataclass
class AttentionMetadata:
    """One step's batch layout. B sequences, T new tokens in all (flattened, sequence after sequence)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot for each new token's K/V
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # [B + 1] int64: offsets of each sequence's new tokens in the batch
    # The most new tokens of any one sequence, when the caller knows it: saves reading query_start_loc back
    # in every layer to pick the kernel.
    max_query_len: int | None = None


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, KVH, D]
    # --kv-cache-dtype int8/fp8 (leverlab/quant/kv_cache.py): per layer [2, num_blocks, block_size, KVH] scales
    kv_scales: list[torch.Tensor] | None = None


_CONTEXT: ForwardContext | None = None


def max_query_len_of(query_start_loc: torch.Tensor) -> int:
    """The most new tokens of any one sequence, read back from query_start_loc [B + 1]."""
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())


@contextmanager
def forward_context(meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                    kv_scales: list[torch.Tensor] | None = None) -> Iterator[None]:
    global _CONTEXT
    _CONTEXT = ForwardContext(meta, kv_caches, kv_scales)
    try:
        yield
    finally:
        _CONTEXT = None


@custom_op("leverlab::paged_attention")
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                    window: int = 0) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for this step's new tokens -> [T, H, D]; writes k/v into layer's cache.
    window > 0: a query at position p sees keys p - window < j <= p only (sliding-window attention)."""
    assert _CONTEXT is not None, "paged_attention runs only inside forward_context()"
    meta, cache = _CONTEXT.meta, _CONTEXT.kv_caches[layer]
    scales = _CONTEXT.kv_scales[layer] if _CONTEXT.kv_scales is not None else (None, None)
    return attention_impl(q, k, v, cache[0], cache[1], meta.slot_mapping, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, scale, k_scale=scales[0], v_scale=scales[1], window=window,
                          max_query_len=meta.max_query_len)


@paged_attention.register_fake
def _(q, k, v, layer, scale, window=0):
    return torch.empty_like(q)


def attention_impl(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, KVH]: set when the cache is int8/fp8
    v_scale: torch.Tensor | None = None,
    window: int = 0,  # > 0: sliding-window attention over the last `window` positions
    max_query_len: int | None = None,  # max new tokens of one sequence; None: read from query_start_loc
) -> torch.Tensor:  # [T, H, D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k.shape[1], k_cache.shape[1]
    int8_cache = k_scale is not None and k_cache.dtype == torch.int8
    if (k_scale is None or int8_cache) and q.device.type == "cpu" and (kern := cpu_kernels.kernels()) is not None:
        if max_query_len is None:
            max_query_len = max_query_len_of(query_start_loc)
        if max_query_len <= KERNEL_MAX_SPAN or kern.has_tiled_attention():
            # Decode and speculative verification (a few queries per sequence): our kernel writes the new K/V
            # and reads each sequence's K/V once per KV head, in place through the block table, with no
            # gather copies and no per-sequence call. An int8 cache is quantized and dequantized inside it.
            # Where it has AVX2 it takes prefill chunks too, in register tiles that skip the causal upper
            # triangle (SDPA's CPU kernel ran at ~7 GFLOP/s on the bundled model's heads, most of a long prefill).
            # On a CPU with AMX, a fresh bf16 prefill (no cached prefix) goes to SDPA from inside the kernel
            # instead: there PyTorch's flash attention runs on AMX tiles, 3.6-9x our float32 tiles.
            if int8_cache:
                return kern.paged_decode(q, k.to(q.dtype), v.to(q.dtype), k_cache, v_cache, slot_mapping,
                                         block_tables, seq_lens, query_start_loc, scale, window, k_scale, v_scale)
            return kern.paged_decode(q, k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, slot_mapping,
                                     block_tables, seq_lens, query_start_loc, scale, window)
    # ---- KV-cache dtype hook (issue 6): quantized caches are written and gathered by quant/kv_cache.py.
    if k_scale is not None:
        kv_quant.write(k_cache, k_scale, k, slot_mapping)
        kv_quant.write(v_cache, v_scale, v, slot_mapping)
    else:
        blk, row = slot_mapping // block_size, slot_mapping % block_size  # by index: either layout (allocate)
        k_cache[blk, row] = k.to(k_cache.dtype)
        v_cache[blk, row] = v.to(v_cache.dtype)

    def blocks(cache, cache_scale, table):  # cache[table] in q's dtype: [*table.shape, block_size, KVH, D]
        if cache_scale is None:
            return cache[table].to(q.dtype)
        return kv_quant.gather(cache, cache_scale, table, q.dtype)
    # ---- end of the hook
    lens = seq_lens.tolist()
    batch = len(lens)
    starts = query_start_loc.tolist()

    if num_tokens == batch:
        # Decode: one query per sequence, attending over its whole context.
        max_len = max(lens)
        nblocks = -(-max_len // block_size)
        table = block_tables[:, :nblocks]
        pos = torch.arange(max_len, device=q.device)[None, :]
        mask = pos < seq_lens[:, None]  # [B, L]
        if window:
            mask &= pos >= seq_lens[:, None] - window

        def head_major(cache, cache_scale):  # -> [KVH, B, L, D] (a view; matmul makes it contiguous)
            g = blocks(cache, cache_scale, table)  # [B, nblocks, BS, KVH, D], one gather copy
            return g.reshape(batch, -1, num_kv_heads, head_dim)[:, :max_len].permute(2, 0, 1, 3)

        keys, values = head_major(k_cache, k_scale), head_major(v_cache, v_scale)
        # Two batched matmuls, not SDPA: its CPU flash kernel is built for long query blocks and spent
        # 5.4 ms per layer on a 16-sequence decode step here (58% of the step).
        group = num_heads // num_kv_heads
        qg = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)  # [KVH, B, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [KVH, B, G, L]
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(num_tokens, num_heads, head_dim)

    # Prefill chunks (possibly mixed with decodes): one attention call per sequence.
    out = torch.empty_like(q)
    for i, ctx in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        nblocks = -(-ctx // block_size)
        table = block_tables[i, :nblocks]
        keys = blocks(k_cache, k_scale, table).reshape(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1)
        values = blocks(v_cache, v_scale, table).reshape(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1)
        qi = q[s:e].transpose(0, 1)  # [H, q_len, D]
        q_len = e - s
        if q_len == ctx and not window:
            mask, causal = None, q_len > 1
        else:
            # The new tokens are the last q_len of the context: query i sees keys 0 .. ctx - q_len + i.
            rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
            cols = torch.arange(ctx, device=q.device)[None, :]
            mask, causal = cols <= rows, False
            if window:
                mask &= cols > rows - window
        o = F.scaled_dot_product_attention(
            qi, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[s:e] = o.transpose(0, 1)
    return out
