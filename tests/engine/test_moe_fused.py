"""The routed experts of a sparse MoE layer in one C++ call (csrc/fused_decoder.cpp MoeExperts, attached by
models/fused.py fused_moe) against the module path's expert loop (models/moe.py expert_outputs), the reference:
float32 equal, quantized experts through the same streaming kernels, and the engine's greedy tokens unchanged.
Then the whole sparse block in C++ (MoeExperts.block: routing and shared expert too) and the whole MoE decode step
in the fused decoder (FusedDecoder.set_moe) against the module path and transformers."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.models import fused
from leverlab.models.loader import load_model
from leverlab.models.moe import SparseMoE, expert_outputs
from leverlab.quant import autotune
from tests.checkpoints import MOE_ARCHS
from tests.engine.helpers import hf_greedy
from tests.engine.test_fused_decode import both_paths

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


def module_block(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """SparseMoE.forward through the module loop (its C++ op off for this call)."""
    kernel, moe.kernel = moe.kernel, None
    try:
        with torch.no_grad():
            return moe(x)
    finally:
        moe.kernel = kernel


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cpp_block_equals_the_module_block_in_float32(checkpoint_factory, arch):
    """Router, experts and (Qwen2-MoE) shared expert in one C++ call: bit-equal to SparseMoE.forward."""
    model = load_model(checkpoint_factory(arch), "float32")
    fused.fused_moe(model)
    for moe in sparse_layers(model):
        for rows in (1, 3, 16, 32):
            x = torch.randn(rows, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(rows))
            assert torch.equal(moe.kernel.block(x), module_block(moe, x))


@pytest.mark.parametrize("method", (None, "int8", "int4-g32"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("arch", ("qwen3-moe", "qwen2-moe"))
def test_cpp_block_equals_the_module_block_quantized(checkpoint_factory, arch, method, dtype, monkeypatch):
    """bf16 and quantized experts (and shared expert) through the same kernels: bit-equal, with the threads taking
    whole experts (at most fused.EXPERT_SPLIT_ROWS rows each) and past that."""
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "2")
    model = load_model(checkpoint_factory(arch), str(dtype).split(".")[1], quantization=method)
    fused.fused_moe(model)
    for moe in sparse_layers(model):
        for rows in (1, 2, 16, 32):
            if rows <= moe.kernel_rows:
                x = torch.randn(rows, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
                assert torch.equal(moe.kernel.block(x), module_block(moe, x))


def test_threads_taking_whole_experts_change_no_bit(checkpoint_factory):
    """bf16 int4 experts: the split of the hit experts among the threads gives the per-linear split's bits."""
    model = load_model(checkpoint_factory("qwen3-moe"), "bfloat16", quantization="int4-g32")
    fused.fused_moe(model)
    moe = sparse_layers(model)[0]
    x = torch.randn(3, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    moe.kernel.set_expert_split(0)
    per_linear = moe.kernel.block(x)
    moe.kernel.set_expert_split(fused.EXPERT_SPLIT_ROWS)
    assert torch.equal(moe.kernel.block(x), per_linear)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_step_runs_moe_models_like_the_modules(checkpoint_factory, arch):
    """The whole forward of decode, batch and verification spans in one C++ call, sparse layers included (Qwen2-MoE:
    a dense layer by mlp_only_layers and a shared expert), as the module path computes it in float32."""
    model = load_model(checkpoint_factory(arch), "float32")
    fused.fused_moe(model)
    for spans in ([1], [1, 1, 1], [4, 1, 16]):
        expected, got = both_paths(model, torch.float32, spans)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.compute_logits(got), model.compute_logits(expected), atol=1e-5, rtol=1e-5)


def test_fused_step_needs_the_experts_op_first(checkpoint_factory):
    """Without fused_moe's ops the fused decoder declines (the module path runs), naming why."""
    model = load_model(checkpoint_factory("qwen3-moe"), "float32")
    caches = [torch.zeros(2, 4, 16, model.config.num_kv_heads, model.config.head_dim)] * model.config.num_layers
    assert fused.fused_decoder(model, caches, "auto", 1) is None


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_decodes_moe_through_the_fused_step(checkpoint_factory, monkeypatch, arch):
    """float32 greedy decode of a batch: the fused step takes the decode steps, with the module path's tokens
    (LEVERLAB_NO_FUSED_DECODE=1) and transformers'."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory(arch)
    llm = LLM(path, dtype="float32")
    assert llm.engine.runner.fused is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.engine.runner.fused_steps > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    monkeypatch.setenv("LEVERLAB_NO_FUSED_DECODE", "1")
    plain = LLM(path, dtype="float32")
    assert plain.engine.runner.fused is None
    assert got == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]


def test_phase_timing_names_the_sparse_blocks(checkpoint_factory):
    """The fused step's phase timers (scripts/profile_step.py) give an MoE model's sparse MLP blocks their own phase,
    and its dense layer (Qwen2-MoE's mlp_only_layers) its dense ones."""
    llm = LLM(checkpoint_factory("qwen2-moe"), dtype="float32")
    dec = llm.engine.runner.fused.dec
    dec.set_phase_timing(True)
    llm.generate(PROMPTS[:1], GREEDY)
    dec.set_phase_timing(False)
    times = dict(dec.phase_times())
    assert list(times) == ["norms", "qkv", "rope", "attention", "o", "gate_up", "act", "down", "moe", "head", "steps"]
    assert times.pop("steps") > 0 and all(v > 0 for v in times.values())


@pytest.mark.parametrize("arch", ("qwen3-moe", "qwen2-moe"))
def test_fused_step_hands_its_experts_to_the_read_counters(checkpoint_factory, arch):
    """The fused step routes in C++, out of the routers' Python hooks: it hands each sparse layer's distinct experts
    to models/expert_reads.py itself, and counts what the module path counts (float32: the same routing)."""
    path = checkpoint_factory(arch)

    def counts(llm):
        llm.generate(PROMPTS, GREEDY)
        c = llm.engine.counter_snapshot()
        assert c["moe_decode_passes_uncounted"] == 0 and c["moe_decode_passes"] > 0
        return c["moe_decode_passes"], c["moe_experts_read"], c["moe_weight_bytes_read"]

    llm = LLM(path, dtype="float32")
    got = counts(llm)
    assert llm.engine.runner.fused_steps > 0
    plain = LLM(path, dtype="float32")
    plain.engine.runner.fused = None
    assert got == counts(plain)
