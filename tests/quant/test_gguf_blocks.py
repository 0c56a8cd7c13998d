"""GGUF's Q8_0 and Q4_0 blocks unpacked by quant/layouts.py equal the gguf package's own dequantization, and Q4_0
staged into int4 (groups of 32, zero point 8) packs into every streaming layout without changing a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from leverlab.quant.layouts import (
    dequantize_int4,
    dequantize_streaming,
    pack_int4_panels,
    pack_int4_streaming,
    unpack_q4_0,
    unpack_q8_0,
)


def _weights(out: int = 48, k: int = 256) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((out, k)) * 0.05).astype(np.float32)


def test_q8_0_unpacks_to_the_gguf_dequantization():
    raw = gguf_quants.quantize(_weights(), T.Q8_0)
    q, d = unpack_q8_0(torch.from_numpy(raw))
    w = (q.float().view(q.shape[0], -1, 32) * d[..., None]).view(q.shape)
    assert torch.equal(w, torch.from_numpy(gguf_quants.dequantize(raw, T.Q8_0)))


def test_q4_0_is_int4_at_groups_of_32_exactly():
    raw = gguf_quants.quantize(_weights(), T.Q4_0)
    want = torch.from_numpy(gguf_quants.dequantize(raw, T.Q4_0))
    q, s, z = unpack_q4_0(torch.from_numpy(raw))
    assert int(q.max()) <= 15 and bool((z == 8).all())
    assert torch.equal(dequantize_int4(q, s, z, 32), want)
    assert torch.equal(dequantize_streaming(*pack_int4_streaming(q, s, z, 32)), want)  # fp16 scales: no rounding
    _, ss = pack_int4_streaming(q, s, z, 32)
    assert torch.equal(dequantize_streaming(pack_int4_panels(q, s, z, 32), ss), want)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_zero_point_free_panels_give_the_kernel_the_same_weight(rows):
    """Q4_0's panels without their zero points (all 8) stream to the same outputs, bit for bit, as int4-g32's
    panels with them; both unpack to the same rows (float32 activations and the dequantization read those)."""
    from leverlab.kernels import cpu_kernels

    kern = cpu_kernels.kernels()
    if kern is None or not kern.has_fast_int6():
        pytest.skip("the panels need AVX-512 VNNI")
    q, s, z = unpack_q4_0(torch.from_numpy(gguf_quants.quantize(_weights(64, 512), T.Q4_0)))
    _, ss = pack_int4_streaming(q, s, z, 32)
    full, sym = pack_int4_panels(q, s, z, 32), pack_int4_panels(q, s, z, 32, symmetric=True)
    assert sym.shape[2] == 8 * 32 + 32 and full.shape[2] == 8 * 32 + 64  # 18 bytes a block of 32, against 20
    assert torch.equal(dequantize_streaming(sym, ss), dequantize_streaming(full, ss))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(kern.int4_linear(x, sym, ss, 32, None), kern.int4_linear(x, full, ss, 32, None))
    x32 = x.float()
    assert torch.equal(kern.int4_linear(x32, sym, ss, 32, None), kern.int4_linear(x32, full, ss, 32, None))
