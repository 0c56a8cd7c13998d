"""bfloat16 linear layers for decode-sized batches on CPU.

A decode step multiplies a handful of activation rows by every weight matrix, so its matmuls stream the
weights and should run at memory bandwidth. aten's bf16 linear falls well short of that for a few rows;
our AVX-512 BF16 kernel (csrc/skinny_linear.cpp) streams several weight rows at once, prefetching ahead, and
is used for up to MAX_ROWS rows (scripts/bench_linear.py measures both; figures in docs/engine.md): single
streams, small batches and speculative verification. Larger batches, prefill, other dtypes and CPUs without
AVX-512 BF16 keep aten's linear.

It is a torch custom op so that a compiled model treats it as one opaque call (the branch on the row count
happens at run time, not as a graph guard).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from leverlab.layers import cpu_kernels

# scripts/bench_linear.py, one thread: the kernel streams at 23-25 GB/s for 1-4 rows against aten's 15, and
# 15.2 against 13.7 for 8 rows; beyond that aten's blocked GEMM is left to do it.
MAX_ROWS = 8


_AVAILABLE: bool | None = None


@torch.compiler.assume_constant_result  # a compiled graph takes the answer as a constant, never traces the build
def available() -> bool:
    """Whether the kernel can run here; LEVERLAB_NO_SKINNY_LINEAR=1 keeps aten's linear (for A/B runs)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        k = None if os.environ.get("LEVERLAB_NO_SKINNY_LINEAR") == "1" else cpu_kernels.kernels()
        _AVAILABLE = k is not None and bool(k.has_skinny_linear())
    return _AVAILABLE


def wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Static checks (dtype, device, no autograd), decided once per compiled graph."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and not (x.requires_grad or weight.requires_grad) and available())


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] bf16, weight [out, in] bf16 -> [T, out]: our kernel for T <= MAX_ROWS, aten's otherwise."""
    if x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous():
        return cpu_kernels.kernels().skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


linear_bf16 = torch.library.custom_op("leverlab::linear_bf16", _linear, mutates_args=())


@linear_bf16.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op inside a compiled graph; a direct call in eager mode, where the custom op's dispatch costs
    ~7 us per call (measured: 9.9 against 3.1 us for a one-row 384x384 call), ~0.3 ms of the bundled model's
    3.4 ms eager decode step (41 linears)."""
    return linear_bf16(x, weight, bias) if torch.compiler.is_compiling() else _linear(x, weight, bias)
