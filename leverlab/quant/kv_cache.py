"""KV-cache quantization (`--kv-cache-dtype int8 | fp8`): K and V stored in one byte per element, with one
float32 scale per (token, KV head) kept beside the cache.

Layout, per layer: the cache [2, num_blocks, block_size, KVH, D] in int8 (or float8_e4m3fn) and its scales
[2, num_blocks, block_size, KVH] float32, indexed by the same slots. A token's K (and V) for one head is
quantized when written - symmetric, scale = max|x| / 127 (int8) or / 448 (fp8 e4m3) - and dequantized to the
activation dtype when attention gathers the context. Per token and head, so one outlier token or head never
coarsens the others, and writes never rescale what is already cached.
Memory per token and head: D + 4 bytes against 2D for bf16 (D = 128: 0.52x; D = 64: 0.53x), so about twice
the sequences fit in the same --kv-cache-memory. The attention arithmetic still runs in the model dtype.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype -> (storage dtype, largest representable magnitude)
_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
SCALE_DTYPE = torch.float32


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in _FORMATS


def bytes_per_token(kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int, kv_heads: int,
                    head_dim: int) -> int:
    """K and V bytes for one token over all layers, scales included."""
    if not is_quantized(kv_cache_dtype):
        return 2 * num_layers * kv_heads * head_dim * torch.finfo(model_dtype).bits // 8
    return 2 * num_layers * kv_heads * (head_dim + SCALE_DTYPE.itemsize)


def allocate(kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int, num_blocks: int, block_size: int,
             kv_heads: int, head_dim: int, device) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-layer caches [2, blocks, block_size, KVH, D] and, when quantized, their scales [2, blocks, bs, KVH].

    Indexed as that shape everywhere, but on the CPU stored head-major within a block ([2, blocks, KVH, bs, D] in
    memory, a transposed view): the decode kernel reads one KV head's rows at a time, and so reads block_size rows in a
    row (4 KB for D = 128 in bf16) where the slot-major order gave it D elements out of every KVH * D. Read alone on
    the Zen 1 machine type, two threads, a head at a time over 28 layers x 1,000 tokens: 10-15 GB/s against 8-9 with
    prefetching; decode attention 1.14-1.41x (measured on the Qwen3-0.6B shape; docs/quantization.md). The scales follow the same order,
    so a row's scale sits at its offset / D.
    """
    dtype = _FORMATS[kv_cache_dtype][0] if is_quantized(kv_cache_dtype) else model_dtype
    # Head-major only for the CPU kernel that gains from it; elsewhere the gather path reads plain tensors.
    head_major = torch.device(device).type == "cpu"

    def stored(make, shape, dtype):  # make: torch.zeros / torch.ones; shape as indexed, [2, blocks, bs, KVH, ...]
        if not head_major:
            return make(shape, dtype=dtype, device=device)
        return make((shape[0], shape[1], shape[3], shape[2], *shape[4:]), dtype=dtype, device=device).transpose(2, 3)

    caches = [stored(torch.zeros, (2, num_blocks, block_size, kv_heads, head_dim), dtype) for _ in range(num_layers)]
    if not is_quantized(kv_cache_dtype):
        return caches, None
    scales = [stored(torch.ones, (2, num_blocks, block_size, kv_heads), SCALE_DTYPE) for _ in range(num_layers)]
    return caches, scales


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KVH, D] -> (x_q [T, KVH, D] in `dtype`, scales [T, KVH] float32)."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).clamp(min=1e-8)
    y = xf / scale[..., None]
    y = torch.round(y).clamp(-127, 127) if dtype == torch.int8 else y.clamp(-qmax, qmax)
    return y.to(dtype), scale


def write(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize this step's K (or V) [T, KVH, D] into `cache` [blocks, bs, KVH, D] at `slot_mapping`."""
    xq, s = quantize(x, cache.dtype)
    blk, row = slot_mapping // cache.shape[1], slot_mapping % cache.shape[1]
    # A byte view: index_put_ has no float8 kernels on every backend; the bytes are what we copy. Indexing, not a
    # flat view, so that either layout (allocate) takes it.
    cache.view(torch.uint8)[blk, row] = xq.view(torch.uint8)
    scales[blk, row] = s


def gather(cache: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[table] dequantized to `dtype`: [*table.shape, bs, KVH, D]."""
    x = cache.view(torch.uint8)[table].view(cache.dtype)
    return x.to(dtype) * scales[table].unsqueeze(-1).to(dtype)
