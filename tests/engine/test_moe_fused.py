"""The routed experts of a sparse MoE layer in one C++ call (csrc/fused_decoder.cpp MoeExperts, attached by
models/fused.py fused_moe) against the module path's expert loop (models/moe.py expert_outputs), the reference:
float32 equal, quantized experts through the same streaming kernels, and the engine's greedy tokens unchanged."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.models import fused
from leverlab.models.loader import load_model
from leverlab.models.moe import SparseMoE, expert_outputs
from leverlab.quant import autotune
from tests.checkpoints import MOE_ARCHS

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [100, 3, 250, 17, 9, 31, 2, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def sparse_layers(model) -> list[SparseMoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]


def both(moe: SparseMoE, rows: int, dtype: torch.dtype, seed: int = 0):
    """(module path, C++ op) outputs of one layer's routed experts on `rows` random hidden states."""
    x = torch.randn(rows, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    with torch.no_grad():
        weights, chosen = moe.gate(x)
        return expert_outputs(x, weights, chosen, moe.experts), moe.kernel.forward(x, weights, chosen)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cpp_experts_equal_the_module_path_in_float32(checkpoint_factory, arch):
    """Same order of experts, same kernels, same casts: bit-equal in float32, for one row up to the most it takes."""
    model = load_model(checkpoint_factory(arch), "float32")
    moes = sparse_layers(model)
    assert fused.fused_moe(model) == len(moes) > 0
    for moe in moes:
        assert moe.kernel is not None and moe.kernel_rows == fused.MOE_MAX_TOKENS
        for rows in (1, 3, 16, moe.kernel_rows):
            expected, got = both(moe, rows, torch.float32, seed=rows)
            assert torch.equal(got, expected)


@pytest.mark.parametrize("method", ("int8", "int4-g32"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cpp_experts_equal_the_module_path_quantized(checkpoint_factory, method, dtype, monkeypatch):
    """Quantized experts through the same kernels from C++ and from their modules, bit-equal: each expert streams up
    to 2 rows (LEVERLAB_STREAM_ROWS, as the dense fused tests fix it) and past them takes the int8 GEMM where its
    module would (autotune.eligible: then the op takes steps of up to 32 tokens), else the op stops at the rows
    they stream (float32: int8 and int4 have no GEMM beside the streaming kernel, which takes 16 rows).
    16 tokens give the tiny model's 8 experts about 4 rows each: both kernels in one step."""
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "2")
    model = load_model(checkpoint_factory("qwen3-moe"), str(dtype).split(".")[1], quantization=method)
    assert fused.fused_moe(model) > 0
    for moe in sparse_layers(model):
        lins = [lin for e in moe.experts for lin in (e.gate_up_proj, e.down_proj)]
        covered = all(autotune.eligible(lin) for lin in lins)
        assert moe.kernel_rows == (fused.MOE_MAX_TOKENS if covered else min(lin.kernel_state.stream_rows for lin in lins))
        if dtype == torch.bfloat16 and method == "int8":
            assert covered  # the case that matters: batched decode of an int8 bf16 model
        for rows in (1, 2, 16, 32):
            if rows <= moe.kernel_rows:
                expected, got = both(moe, rows, dtype, seed=rows)
                assert torch.equal(got, expected)


def test_longer_steps_keep_the_module_loop(checkpoint_factory):
    """Past kernel_rows (a prefill chunk) each hit expert's module runs, as before."""
    model = load_model(checkpoint_factory("qwen3-moe"), "float32")
    fused.fused_moe(model)
    moe = sparse_layers(model)[0]
    calls = []
    for expert in moe.experts:
        expert.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    h = moe.gate.weight.shape[1]
    with torch.no_grad():
        moe(torch.randn(moe.kernel_rows, h))
        assert calls == []  # the C++ op
        moe(torch.randn(moe.kernel_rows + 1, h))
    assert sum(calls) == (moe.kernel_rows + 1) * moe.gate.top_k


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_tokens_identical_with_and_without_the_cpp_experts(checkpoint_factory, monkeypatch, arch):
    """float32 greedy decode of a batch through the engine: the same tokens with LEVERLAB_NO_FUSED_MOE=1."""
    path = checkpoint_factory(arch)
    llm = LLM(path, dtype="float32")
    assert all(m.kernel is not None for m in sparse_layers(llm.engine.runner.model))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    monkeypatch.setenv("LEVERLAB_NO_FUSED_MOE", "1")
    plain = LLM(path, dtype="float32")
    assert all(m.kernel is None for m in sparse_layers(plain.engine.runner.model))
    assert got == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
