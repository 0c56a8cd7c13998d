"""The AMX int8 GEMM (kernels/csrc/amx_int8.cpp) behind quant/int8_gemm.py on CPUs with AMX: its padded layout, and
its product against the same integer arithmetic written in PyTorch, bit for bit."""

import pytest
import torch

from leverlab.quant import int8_gemm

SHAPES = [(1, 5, 7), (3, 40, 70), (16, 64, 128), (33, 100, 300), (300, 96, 64), (64, 33, 65), (17, 1000, 256),
          (257, 130, 128)]  # (M, N, K): tails of every block, several threads' chunks, more rows than a chunk


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    s = w.abs().amax(1) / 127
    return (w / s[:, None]).round().clamp(-127, 127).to(torch.int8), s


def reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """amx_int8_linear's arithmetic: x per row to int8 (q = round(x * (127 / max|x|)), half to even), exact integer
    sums, then sums * (max|x| / 127) * s_w in float32, rounded once to x's dtype."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    # a tensor division: `127.0 / amax` is computed as amax.reciprocal() * 127, one rounding more than the kernel's
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    sums = ((xf * inv).round().double() @ q.double().t()).float()  # exact: |sums| < 2^24 here
    return (sums * (amax / 127.0) * s[None, :]).to(x.dtype)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_amx_weight_is_its_rows_padded_with_zeros(m, n, k):
    q, s = _weight(n, k)
    w = int8_gemm.pack_amx(q, s)
    np_, kp = w.packed.shape
    assert np_ % 32 == 0 and np_ - n < 32 and kp % 64 == 0 and kp - k < 64 and w.packed.is_contiguous()
    assert torch.equal(int8_gemm.unpack_amx(w), q) and torch.equal(w.packed[:n, :k], q)
    assert int(w.packed.abs().sum()) == int(q.abs().sum())  # the padding is zeros


amx = pytest.mark.skipif(int8_gemm.amx_kernels() is None, reason="no AMX int8 on this CPU or build")


@amx
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_amx_product_is_the_per_row_integer_product(m, n, k, dtype):
    q, s = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    x[m // 2] *= 1000  # a loud row keeps its own scale
    if m > 2:
        x[1] = 0  # an all-zero row: zero scale, zero output
    w = int8_gemm.pack_amx(q, s)
    y = int8_gemm.amx_kernels().amx_int8_linear(x, w.packed, w.scales)
    assert y.dtype == dtype and y.shape == (m, n)
    assert torch.equal(y, reference(x, q, s))


@amx
def test_quantized_layers_batch_on_amx_tiles_where_they_run():
    """On an AMX CPU the int8 copy that int8 and int4 layers keep for batched rows is packed in tiles, and a
    batch past the streaming rows is that product plus the bias."""
    from tests.quant.test_methods import quantized_linear

    for name in ("int8", "int4"):
        layer, _, b = quantized_linear(name, torch.bfloat16)
        w = int8_gemm.packed(layer.kernel_state.int8_key)
        assert isinstance(w, int8_gemm.AmxWeight)
        q, s = int8_gemm.unpack(layer.kernel_state.int8_key)
        x = torch.randn(40, 256).to(torch.bfloat16)
        assert torch.equal(layer(x), reference(x, q, s) + layer.bias)


def test_refuses_a_weight_that_does_not_fit_x_and_an_unsupported_dtype():
    k = int8_gemm.amx_kernels()
    if k is None:
        pytest.skip("no AMX int8 on this CPU or build")
    w = int8_gemm.pack_amx(*_weight(32, 64))
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        k.amx_int8_linear(torch.randn(2, 128), w.packed, w.scales)
    with pytest.raises(RuntimeError, match="bfloat16, float16 or float32"):
        k.amx_int8_linear(torch.randn(2, 64, dtype=torch.float64), w.packed, w.scales)
