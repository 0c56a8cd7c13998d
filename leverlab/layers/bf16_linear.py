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
