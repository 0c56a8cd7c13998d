"""bf16 decode rows on AMX tiles (kernels/csrc/amx_bf16.cpp) on CPUs with AMX: the product against float64 within
one rounding, each row independent of the rest of the batch, the op's dispatch, and clear refusals."""

import pytest
import torch
import torch.nn.functional as F

from leverlab.kernels import cpu_kernels
from leverlab.layers import bf16_linear
from leverlab.layers.linear import Linear

kern = cpu_kernels.kernels()
needs_amx = pytest.mark.skipif(kern is None or not kern.amx_bf16_enabled(),
                               reason="no AMX-BF16 here (or LEVERLAB_NO_AMX=1)")


def _case(m: int, n: int, k: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    # x as a slice of a wider buffer: rows with a stride longer than K, as a view of a fused projection gives them
    x = torch.randn(m, k + 32, generator=g).bfloat16()[:, 16:16 + k]
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@needs_amx
@pytest.mark.parametrize("m", [1, 2, 7, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("n,k", [(37, 64), (100, 96), (1000, 1024), (64, 2048), (129, 32)])  # N tails of a block
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_match_the_exact_product(m, n, k, bias):
    x, w, b = _case(m, n, k, m * 1000 + n, bias)
    exact = F.linear(x.double(), w.double(), b.double() if bias else None)
    ours = kern.amx_bf16_linear(x, w, b)
    # fp32 sums rounded once to bf16: within half a bf16 ulp of the exact value, plus the sums' own rounding
    tol = exact.abs() * 2**-8 + x.double().abs() @ w.double().abs().t() * k * 2**-24 + 1e-6
    assert ((ours.double() - exact).abs() <= tol).all()
    assert torch.equal(torch.ops.leverlab_cpu.linear_bf16(x, w, b), ours)  # what models call, here on tiles
    for i in (0, m - 1):  # a row's result does not depend on the batch beside it
        assert torch.equal(kern.amx_bf16_linear(x[i:i + 1], w, b)[0], ours[i])


@needs_amx
def test_switch_hands_rows_to_the_streaming_kernel_and_back():
    x, w, b = _case(16, 200, 256, 3, True)
    on = torch.ops.leverlab_cpu.linear_bf16(x, w, b)
    try:
        assert kern.set_amx_bf16(False) is False and not bf16_linear.on_tiles(256)
        assert torch.equal(torch.ops.leverlab_cpu.linear_bf16(x, w, b), kern.skinny_linear(x, w, b))
    finally:
        assert kern.set_amx_bf16(True) is True
    assert bf16_linear.on_tiles(256) and not bf16_linear.on_tiles(100)  # K not a multiple of 32 streams
    assert torch.equal(torch.ops.leverlab_cpu.linear_bf16(x, w, b), on)


@needs_amx
def test_rows_the_tiles_do_not_take_go_elsewhere_and_direct_calls_are_refused():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 100, generator=g).bfloat16()
    x = torch.randn(4, 100, generator=g).bfloat16()  # K = 100: the streaming kernel, through the op
    assert torch.equal(torch.ops.leverlab_cpu.linear_bf16(x, w, None), kern.skinny_linear(x, w, None))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        kern.amx_bf16_linear(x, w, None)
    w, x = torch.randn(64, 128).bfloat16(), torch.randn(33, 128).bfloat16()  # 33 rows: aten's GEMM
    assert torch.allclose(torch.ops.leverlab_cpu.linear_bf16(x, w, None).float(), F.linear(x, w).float(),
                          rtol=0.02, atol=0.05)
    with pytest.raises(RuntimeError, match=r"x \[1..32, K\]"):
        kern.amx_bf16_linear(x, w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kern.amx_bf16_linear(x[:4].float(), w.float(), None)
    with pytest.raises(RuntimeError, match="bias has 3 elements"):
        kern.amx_bf16_linear(x[:4], w, torch.zeros(3, dtype=torch.bfloat16))


@needs_amx
def test_loader_measures_no_prefetch_for_layers_on_tiles(checkpoint_factory, monkeypatch):
    """The bf16 rows of a decode step issue no software prefetch on tiles: the loader has no bf16 family to time."""
    from leverlab.layers import prefetch_tune
    from leverlab.models.loader import load_model

    monkeypatch.setattr(prefetch_tune, "_largest_tuned", 0)
    model = load_model(checkpoint_factory("qwen3"), "bfloat16")
    assert all(m.in_features % 32 == 0 for m in model.modules() if isinstance(m, Linear))
    assert prefetch_tune.tune(model) is None
