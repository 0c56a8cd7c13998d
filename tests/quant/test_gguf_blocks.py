"""GGUF's Q8_0 and Q4_0 blocks unpacked by quant/layouts.py equal the gguf package's own dequantization, and Q4_0
staged into int4 (groups of 32, zero point 8) packs into every streaming layout without changing a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leverlab.quant.layouts import (
    dequantize_int4,
    dequantize_streaming,
    pack_int4_panels,
    pack_int4_streaming,
    unpack_q4_0,
    unpack_q8_0,
)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as T  # noqa: E402


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
