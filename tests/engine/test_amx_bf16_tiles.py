"""bf16 layers held in AMX tile order (kernels/csrc/amx_bf16_tiles.cpp, layers/bf16_linear.py to_tiles) on CPUs with
AMX: the same bits as the in-place tile kernel for decode rows; prefill-sized calls on oneDNN over the tiles in place
(the order is oneDNN's own, checked per shape) with aten's bits, or, for a shape oneDNN has no descriptor of, the exact
product within one rounding; the tied embedding looked up in the head's tiles; a loaded model's greedy tokens and
prompt logprobs unchanged; clear refusals."""

import pytest
import torch
import torch.nn.functional as F

from leverlab.kernels import cpu_kernels
from leverlab.layers import bf16_linear
from leverlab.layers.linear import Linear

kern = cpu_kernels.kernels()
needs_tiles = pytest.mark.skipif(kern is None or not kern.amx_bf16_tiles_available(),
                                 reason="no AMX-BF16 here (or LEVERLAB_NO_AMX=1)")
op = torch.ops.leverlab_cpu.linear_bf16_tiles if kern is not None else None


def _case(m: int, n: int, k: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 32, generator=g).bfloat16()[:, 16:16 + k]  # rows with a stride longer than K
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@needs_tiles
@pytest.mark.parametrize("m", [1, 7, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(37, 64), (1024, 1024), (64, 2048)])  # 37: a block's tail, padded in the tiles
@pytest.mark.parametrize("bias", [False, True])
def test_decode_rows_are_the_in_place_kernels_bits(m, n, k, bias):
    x, w, b = _case(m, n, k, m * 1000 + n, bias)
    ours = op(x, kern.amx_bf16_pack(w), n, b)
    assert torch.equal(ours, kern.amx_bf16_linear(x, w, b))  # the same sums in the same order, rounded once


@needs_tiles
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (224, 2048)])
def test_onednn_packs_a_weight_into_the_tiles_bytes_and_runs_prefill_over_them(n, k):
    """oneDNN's own packing of a weight for a prefill-sized GEMM is our tile order byte for byte (onednn_reads
    compares them), and prefill-sized calls then give aten's GEMM's bits: oneDNN reading the tiles in place."""
    _, w, b = _case(1, n, k, n + k, True)
    tiles = kern.amx_bf16_pack(w)
    assert bf16_linear.onednn_reads(w, tiles)
    for m in (33, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert torch.equal(op(x, tiles, n, b), F.linear(x, w, b))
        assert torch.equal(op(x, tiles, n, None), F.linear(x, w))


@needs_tiles
def test_a_shape_oneDNN_would_read_in_another_order_stays_in_place(monkeypatch):
    layer = Linear(64, 128)
    layer.weight.data = torch.randn(128, 64).bfloat16()
    before = layer.weight
    monkeypatch.setitem(bf16_linear._ONEDNN_SHAPES, (128, 64), False)
    assert not bf16_linear.to_tiles(layer)
    assert layer.weight is before and layer.weight.shape == (128, 64) and not layer.kernel_state.tiles


@needs_tiles
@pytest.mark.parametrize("m", [33, 70, 300])
@pytest.mark.parametrize("n,k", [(37, 64), (160, 1024), (96, 3072)])
def test_prefill_rows_match_the_exact_product(m, n, k):
    """Shapes no descriptor was registered for (37: not even a whole block): the rows put back for aten's GEMM."""
    x, w, b = _case(m, n, k, m + n, True)
    tiles = kern.amx_bf16_pack(w)
    ours = op(x, tiles, n, b)
    exact = F.linear(x.double(), w.double(), b.double())
    tol = exact.abs() * 2**-8 + x.double().abs() @ w.double().abs().t() * k * 2**-24 + 1e-6
    assert ((ours.double() - exact).abs() <= tol).all()
    for i in (0, m - 1):  # a row's result does not depend on the batch beside it (nor on GEMM or decode pass)
        assert torch.equal(op(x[i:i + 1], tiles, n, b)[0], ours[i])


@needs_tiles
@pytest.mark.parametrize("m", [1, 16, 40])
def test_a_rows_result_does_not_depend_on_the_threads(m):
    """Decode calls share the blocks among the threads (row_split.h), each thread's streamed stores fenced."""
    x, w, b = _case(m, 1024, 256, 11, True)
    tiles = kern.amx_bf16_pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, tiles, 1024, b)
        torch.set_num_threads(2)
        assert torch.equal(op(x, tiles, 1024, b), one)
    finally:
        torch.set_num_threads(before)


@needs_tiles
def test_layout_round_trips_and_rows_are_looked_up():
    w = torch.randn(96, 64).bfloat16()
    tiles = kern.amx_bf16_pack(w)
    assert tiles.shape == (3, 2, 1024)
    assert torch.equal(bf16_linear.untile(tiles), w)
    ids = torch.tensor([[0, 5, 17], [31, 32, 95]])
    assert torch.equal(bf16_linear.embedding(ids, tiles), w[ids])
    x = torch.randn(2, 3, 64).bfloat16()  # leading dims kept
    assert torch.equal(op(x, tiles, 96, None), op(x.view(6, 64), tiles, 96, None).view(2, 3, 96))


@needs_tiles
def test_bad_calls_are_refused():
    w = torch.randn(64, 64).bfloat16()
    tiles = kern.amx_bf16_pack(w)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        kern.amx_bf16_pack(torch.randn(64, 100).bfloat16())
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., 64\] bfloat16"):
        op(torch.randn(4, 64), tiles, 64, None)
    with pytest.raises(RuntimeError, match="does not match tiles of 64 rows"):
        op(torch.randn(4, 64).bfloat16(), tiles, 65, None)
    with pytest.raises(RuntimeError, match="bias has 3 elements"):
        op(torch.randn(4, 64).bfloat16(), tiles, 64, torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="amx_bf16_pack's layout"):
        op(torch.randn(4, 64).bfloat16(), w, 64, None)
    with pytest.raises(RuntimeError, match="outside the table's 64 rows"):
        kern.tile_rows(tiles, torch.tensor([64]))


@needs_tiles
def test_a_loaded_bf16_models_layers_are_in_tile_order_and_say_the_same(checkpoint_factory, monkeypatch):
    """Every Linear in tile order (models/loader.py tile_bf16_layers), the tied head and the embedding one tensor;
    greedy tokens and prompt logprobs as with every layer in place: decode-sized calls share their bits with the
    in-place kernel, prefill-sized ones with aten's GEMM."""
    from leverlab import LLM, SamplingParams

    path = checkpoint_factory("qwen3")  # tied embeddings; every dimension a multiple of 32
    prompts = [[5, 9, 2, 7], [11, 3, 8, 1, 4, 6, 2, 9, 13], list(range(3, 70))]  # the last: 67 prefill rows
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for tiles in (True, False):
        if not tiles:
            monkeypatch.setenv("LEVERLAB_NO_BF16_TILES", "1")
        llm = LLM(path, dtype="bfloat16", num_threads=1)
        model = llm.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.kernel_state.tiles == tiles and (m.weight.dim() == 3) == tiles for m in linears)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        outs[tiles] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    params)]
        # 40 prompt rows through the head at once: a prefill-sized call of the head too
        (o,) = llm.generate([{"prompt_token_ids": list(range(3, 43))}],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
        outs[tiles].append(o.prompt_logprobs)
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
        del llm
    assert outs[True] == outs[False]
