"""int8 x int8 GEMM for the CPU: fbgemm's dynamic-quantization linear, behind an opaque custom op.

Why this kernel: PyTorch's weight-only int8 kernel (`_weight_int8pack_mm`) is GEMV-shaped, and under
torch.compile Inductor's lowerings of both it and `torch._int_mm` were slower than its own bf16 GEMM on these
CPUs (`_int_mm` at 16 rows by ~50x: scripts/bench_quant_kernels.py). fbgemm's `quantized::linear_dynamic`
(VNNI int8 with a prepacked weight) reads the int8 weight at a far higher rate at one row and stays
fast at 16+. As a custom op the compiled graph treats it as one opaque call (like paged attention), so
Inductor never re-lowers it and one graph serves every batch size.

Activation quantization is per row (token), though fbgemm quantizes its input per tensor: each row is
divided by its own max|x| first, so every row spans [-1, 1] and gets the same resolution whatever its
neighbours (a loud prefill token cannot coarsen the others), and y = r * (x / r) W^T is scaled back.
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch

from leverlab.custom_op import custom_op

AVAILABLE = "fbgemm" in torch.backends.quantized.supported_engines


def _has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# Without VNNI (AVX2: Zen 2/3, Haswell..Skylake client) fbgemm multiplies u8 activations by s8 weights with
# vpmaddubsw, whose int16 pair sums saturate past 32767 (2 * 255 * 127 overflows): measured here, errors of 15%
# of the output's range. reduce_range quantizes activations to 7 bits (2 * 127 * 127 fits), as PyTorch's own
# dynamic quantization does on such CPUs.
REDUCE_RANGE = not _has_vnni()
_PACKED: dict[int, object] = {}  # key -> fbgemm LinearPackedParams (the op takes a key: ScriptObjects do not trace)
_KEYS = itertools.count()


def pack(owner: object, q: torch.Tensor, scales: torch.Tensor) -> int:
    """Prepack q int8 [N, K] with per-row scales [N]; returns the key, released when `owner` is collected."""
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; fbgemm's ops take them
        warnings.simplefilter("ignore", UserWarning)
        qt = torch._make_per_channel_quantized_tensor(
            q.contiguous(), scales.double(), torch.zeros(q.shape[0], dtype=torch.int64), 0)
    key = next(_KEYS)
    _PACKED[key] = torch.ops.quantized.linear_prepack(qt, None)
    weakref.finalize(owner, _PACKED.pop, key, None)
    return key


def packed(key: int) -> object:
    """The prepacked fbgemm weight behind a key (for the fused decode path, which calls the op from C++)."""
    return _PACKED[key]


def unpack(key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales float32 [N]) of a packed weight."""
    qt, _ = torch.ops.quantized.linear_unpack(_PACKED[key])
    return qt.int_repr(), qt.q_per_channel_scales().float()


@custom_op("leverlab::int8_linear")
def int8_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """x [M, K] (any float dtype) -> x W^T [M, N] in x's dtype, activations quantized per row."""
    xf = x.float()
    r = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # [M, 1]
    y = torch.ops.quantized.linear_dynamic(xf / r, _PACKED[key], REDUCE_RANGE)
    return (y * r).to(x.dtype)


@int8_linear.register_fake
def _(x, key, out_features):
    return x.new_empty(x.shape[0], out_features)
