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

On CPUs with AMX int8 (Intel Sapphire Rapids and later) the same op runs our AMX tile GEMM instead
(kernels/csrc/amx_int8.cpp): per-row symmetric int8 activations (the same resolution as above), the weight kept as
zero-padded int8 rows whose 16 x 64-byte blocks are the tiles. fbgemm's VNNI kernel ran the Qwen3-0.6B shape's
prefill GEMMs at about a sixth of the tiles' rate there. LEVERLAB_NO_AMX=1 keeps fbgemm.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from dataclasses import dataclass

import torch

from leverlab import env
from leverlab.kernels import cpu_kernels
from leverlab.kernels.custom_op import custom_op

FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


def _has_vnni() -> bool:
    return bool({"avx512_vnni", "avx_vnni"} & env.cpu_flags())


# Without VNNI (AVX2: Zen 2/3, Haswell..Skylake client) fbgemm multiplies u8 activations by s8 weights with
# vpmaddubsw, whose int16 pair sums saturate past 32767 (2 * 255 * 127 overflows): measured here, errors of 15%
# of the output's range. reduce_range quantizes activations to 7 bits (2 * 127 * 127 fits), as PyTorch's own
# dynamic quantization does on such CPUs.
REDUCE_RANGE = not _has_vnni()
_PACKED: dict[int, object] = {}  # key -> fbgemm LinearPackedParams or AmxWeight (the op takes a key: ScriptObjects do not trace)
_KEYS = itertools.count()


@functools.cache
def amx_kernels():
    """Our CPU kernels where they run AMX int8 here (built for it, and the OS grants the tiles), else None."""
    if env.flag("LEVERLAB_NO_AMX"):
        return None
    k = cpu_kernels.kernels()
    return k if k is not None and k.amx_int8_available() else None


def available() -> bool:
    """Whether this machine has an int8 x int8 GEMM for the batched rows: AMX tiles or fbgemm."""
    return amx_kernels() is not None or FBGEMM


@dataclass(frozen=True)
class AmxWeight:
    """An int8 weight as amx_int8.cpp reads it (its rows are the A tiles) and its per-row scales."""

    packed: torch.Tensor  # int8 [Np, Kp]: N rounded up to 32, K to 64, zero padding
    scales: torch.Tensor  # float32 [N]
    shape: tuple[int, int]  # (N, K)


def pack_amx(q: torch.Tensor, scales: torch.Tensor) -> AmxWeight:
    """q int8 [N, K] padded with zeros to [Np, Kp]: 16 rows x 64 bytes of it is one A tile."""
    n, k = q.shape
    packed = torch.zeros(-(-n // 32) * 32, -(-k // 64) * 64, dtype=torch.int8)
    packed[:n, :k] = q
    return AmxWeight(packed, scales.float().contiguous(), (n, k))


def unpack_amx(w: AmxWeight) -> torch.Tensor:
    """The int8 [N, K] weight without its padding."""
    return w.packed[: w.shape[0], : w.shape[1]].contiguous()


def pack(owner: object, q: torch.Tensor, scales: torch.Tensor) -> int:
    """Prepack q int8 [N, K] with per-row scales [N] (AMX tiles where they run, else fbgemm's layout); returns the
    key, released when `owner` is collected."""
    key = next(_KEYS)
    if amx_kernels() is not None:
        _PACKED[key] = pack_amx(q, scales)
    else:
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; fbgemm's ops take them
            warnings.simplefilter("ignore", UserWarning)
            qt = torch._make_per_channel_quantized_tensor(
                q.contiguous(), scales.double(), torch.zeros(q.shape[0], dtype=torch.int64), 0)
        _PACKED[key] = torch.ops.quantized.linear_prepack(qt, None)
    weakref.finalize(owner, _PACKED.pop, key, None)
    return key


def packed(key: int) -> object:
    """The prepacked weight behind a key (for the fused decode path, which calls the kernel from C++)."""
    return _PACKED[key]


def unpack(key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales float32 [N]) of a packed weight."""
    w = _PACKED[key]
    if isinstance(w, AmxWeight):
        return unpack_amx(w), w.scales
    qt, _ = torch.ops.quantized.linear_unpack(w)
    return qt.int_repr(), qt.q_per_channel_scales().float()


@custom_op("leverlab::int8_linear")
def int8_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """x [M, K] (any float dtype) -> x W^T [M, N] in x's dtype, activations quantized per row."""
    w = _PACKED[key]
    if isinstance(w, AmxWeight):  # packed so only where the kernels run AMX
        xs = x if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else x.float()  # the kernel's types
        return cpu_kernels.kernels().amx_int8_linear(xs, w.packed, w.scales).to(x.dtype)
    xf = x.float()
    r = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # [M, 1]
    y = torch.ops.quantized.linear_dynamic(xf / r, w, REDUCE_RANGE)
    return (y * r).to(x.dtype)


@int8_linear.register_fake
def _(x, key, out_features):
    return x.new_empty(x.shape[0], out_features)
