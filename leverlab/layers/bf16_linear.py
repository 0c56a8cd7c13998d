"""bfloat16 linear layers for decode-sized batches on CPU.

A decode step multiplies a handful of activation rows by every weight matrix, so its matmuls stream the
weights and should run at memory bandwidth. aten's bf16 linear falls well short of that for a few rows;
our kernel (csrc/skinny_linear.cpp) reads them as one sequential stream per thread, at the rate `torch.sum`
reads memory (scripts/bench_linear.py measures both; figures in docs/engine.md): single streams, small
batches and speculative verification. It takes up to 32 rows: with AVX-512 BF16 (Zen 4, Sapphire Rapids) in
groups of 8 over pairs of weight rows, 1.2x oneDNN's GEMM at 16 rows and level with it at 32 (a Xeon, session
10); with AVX2 + FMA only (Zen 2/3, older Intel) aten's bf16 GEMM is emulated, and was 4x slower than ours at
16 rows. Larger batches, prefill and other dtypes keep aten's linear.

On CPUs with AMX (Sapphire Rapids and later) the same rows go to AMX tiles instead (csrc/amx_bf16.cpp: 1..32 rows,
W read in place): there vdpbf16ps computes at ~45 G multiply-adds a second on two cores, so 16 rows computed for
about three times as long as the weights took to read, and tiles keep every row count up to 32 a memory stream
(measured: batch-16 bf16 decode of the Qwen3-0.6B shape 2.4x, a single stream 1.14x). LEVERLAB_NO_AMX=1 keeps
the streaming kernel.

The kernel is reached through one op registered in C++, `torch.ops.leverlab_cpu.linear_bf16`, which picks
kernel or aten by the row count at run time: a compiled model treats it as one opaque call (no graph guard
on the row count), and the dispatch costs about a microsecond in eager and compiled modes alike.
"""

from __future__ import annotations

import ctypes

import torch

from leverlab import env
from leverlab.kernels import cpu_kernels

_AVAILABLE: bool | None = None


# A compiled graph takes available()'s answer as a constant and never traces the build: compiled.py marks it
# (torch.compiler.assume_constant_result) when it compiles. Not here, at import: that decorator imports
# torch._dynamo, 1.4 s of every start in eager mode (a server start, each study configuration's).
def available() -> bool:
    """Whether the kernel can run here; LEVERLAB_NO_SKINNY_LINEAR=1 keeps aten's linear (for A/B runs)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        k = None if env.flag("LEVERLAB_NO_SKINNY_LINEAR") else cpu_kernels.kernels()
        _AVAILABLE = k is not None and bool(k.has_skinny_linear())
    return _AVAILABLE


def wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Static checks (dtype, device, no autograd), decided once per compiled graph."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and not (x.requires_grad or weight.requires_grad) and available())


def on_tiles(in_features: int) -> bool:
    """Whether decode rows of a bf16 layer with this many inputs run on AMX tiles here (no software prefetch there,
    so the loader's prefetch measurement has nothing to choose for them)."""
    k = cpu_kernels.kernels() if available() else None
    return k is not None and bool(k.amx_bf16_enabled()) and in_features % 32 == 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] bf16, weight [out, in] bf16 -> [T, out]: AMX tiles or our streaming kernel for T <= 32 rows,
    aten's otherwise."""
    return torch.ops.leverlab_cpu.linear_bf16(x, weight, bias)


# Tile order (csrc/amx_bf16_tiles.cpp): on CPUs with AMX-BF16 a bf16 layer is held as the B tiles its products read,
# each step of a decode pass reading 2 KB contiguous with the next 2 KB requested a step ahead, where the in-place
# kernel reads 32 rows K * 2 bytes apart. The order is the one oneDNN packs a bf16 weight into for a prefill-sized
# GEMM, so prefill reads the same bytes through oneDNN's own prepacked GEMM: one copy serves both.
# LEVERLAB_NO_BF16_TILES=1 keeps every layer in place (A/B runs).
def tiles_available() -> bool:
    """Whether a bf16 layer can be held in tile order here: our kernels with AMX-BF16, not switched off."""
    k = cpu_kernels.kernels() if available() else None
    return (k is not None and bool(k.amx_bf16_tiles_available()) and not env.flag("LEVERLAB_NO_BF16_TILES"))


def tileable(layer) -> bool:
    """Whether a Linear can be held in tile order: unquantized bf16 on the CPU, both dimensions multiples of 32
    (so the tiles hold no padding and the fused decoder reads N from them), no autograd."""
    w = layer.weight
    return (layer.quant_method is None and w is not None and w.dim() == 2 and w.dtype == torch.bfloat16
            and w.device.type == "cpu" and not w.requires_grad and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0)


# Weight shapes [out, in] whose tiles oneDNN reads as its own (True) or not (False), checked once per shape.
_ONEDNN_SHAPES: dict[tuple[int, int], bool] = {}
# The batch size oneDNN is told to pack for: a prefill chunk's. (For one row it picks 64-column blocks instead.)
ONEDNN_PACK_ROWS = 1024


def onednn_reads(weight: torch.Tensor, tiles: torch.Tensor) -> bool:
    """Whether oneDNN packs `weight` [out, in] (bf16) into exactly the bytes of `tiles`, its tile order; the first time
    a shape is seen, oneDNN packs it and the bytes are compared, and where they match its descriptor goes to the
    kernels (set_onednn_md), so that prefill-sized calls of that shape run on oneDNN over the tiles in place.
    Checked rather than assumed: the order is oneDNN's choice (its version, the CPU), and a weight it would read in
    another order must not reach it."""
    key = (int(weight.shape[0]), int(weight.shape[1]))
    if key not in _ONEDNN_SHAPES:
        mk = torch.ops.mkldnn
        packed = mk._reorder_linear_weight(weight, ONEDNN_PACK_ROWS)
        nbytes = mk._nbytes(packed)
        same = nbytes == tiles.numel() * tiles.element_size()
        if same:  # oneDNN's buffer viewed in place (no copy), against the tiles' bytes
            view = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(mk.data_ptr(packed)), dtype=torch.uint8)
            same = torch.equal(view, tiles.reshape(-1).view(torch.uint8))
        if same:
            cpu_kernels.kernels().set_onednn_md(key[0], key[1], mk._get_mkldnn_serialized_md(packed))
        _ONEDNN_SHAPES[key] = same
    return _ONEDNN_SHAPES[key]


def to_tiles(layer) -> bool:
    """Re-hold `layer.weight` in tile order, [out/32, in/32, 1024] bf16 (the row-major copy freed), where oneDNN reads
    that order for prefill (onednn_reads); returns whether it did. The layer's method (layers/linear.py) then runs
    through linear_bf16_tiles."""
    if _ONEDNN_SHAPES.get(tuple(layer.weight.shape)) is False:
        return False
    tiles = cpu_kernels.kernels().amx_bf16_pack(layer.weight.data)
    if not onednn_reads(layer.weight.data, tiles):
        return False
    layer.weight = torch.nn.Parameter(tiles, requires_grad=False)
    layer.kernel_state.tiles = True
    return True


def tiled_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] bf16 against a weight in tile order -> [..., out] (out: 32 a block, tileable() holds no padding)."""
    return torch.ops.leverlab_cpu.linear_bf16_tiles(x, tiles, tiles.shape[0] * 32, bias)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table: [V, H] as usual, or [V/32, H/32, 1024] when it is a tied head's tiles."""
    if table.dim() == 3:
        return cpu_kernels.kernels().tile_rows(table, ids.reshape(-1).long()).view(*ids.shape, -1)
    return torch.nn.functional.embedding(ids, table)


def untile(tiles: torch.Tensor) -> torch.Tensor:
    """A weight in tile order back to [out, in] rows (tile order: [out/32][in/32][16 pairs][32 rows][2])."""
    nb, steps, _ = tiles.shape
    return tiles.view(nb, steps, 16, 32, 2).permute(0, 3, 1, 2, 4).reshape(nb * 32, steps * 32)
