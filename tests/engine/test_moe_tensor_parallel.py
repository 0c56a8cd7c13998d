"""Mixture-of-experts models at --tensor-parallel-size 2 (real worker processes): every expert sharded over the
ranks by its width, the router replicated, one all-reduce per MoE layer. Float32 greedy tokens equal TP=1's and
transformers'; quantized experts run on each rank's slice.

Each TP=2 engine starts one worker process (a few seconds), and only one tensor-parallel engine may run per
process at a time: each test closes its engine."""

from __future__ import annotations

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.errors import UnsupportedLever
from leverlab.models.moe import SparseMoE
from tests.checkpoints import MOE_ARCHS
from tests.engine.helpers import hf_greedy
from tests.engine.helpers import tp_engine as engine  # closing: the fixture in tests/engine/conftest.py

# A decode alone, a prompt of a few blocks (chunked by the 64-token budget when batched with the others), and
# one of 70 tokens split over two chunks: prefill runs the module loop, decode steps the C++ experts op.
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [100, 3, 250, 17, 9, 31, 2, 8], list(range(5, 75))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def sparse_layers(llm: LLM) -> list[SparseMoE]:
    return [layer.mlp for layer in llm.engine.runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tp2_tokens_identical_to_tp1_and_transformers(checkpoint_factory, closing, arch):
    """qwen2-moe: a shared expert and its gate, layer 1 dense (mlp_only_layers); mixtral: float32 routing weights."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory(arch)
    expected = tokens(engine(path, 1))
    llm = closing(path, 2)
    got = tokens(llm)
    assert got == expected
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i in (1, 3):
        assert got[i] == hf_greedy(ref, PROMPTS[i], GREEDY.max_tokens)
    eng, cfg = llm.engine, llm.engine.runner.model.config
    assert eng.blocks.num_free == eng.blocks.num_blocks
    # Rank 0 holds half of every expert's width (and of the shared expert's), and the C++ op over those halves.
    moes = sparse_layers(llm)
    assert moes and all(m.kernel is not None for m in moes)
    for m in moes:
        assert all(e.gate_up_proj.out_features == cfg.moe_intermediate_size for e in m.experts)  # 2 x I / 2
        assert all(e.down_proj.in_features == cfg.moe_intermediate_size // 2 for e in m.experts)
        if m.shared_expert is not None:
            assert m.shared_expert.down_proj.in_features == cfg.shared_expert_intermediate_size // 2
    # One all-reduce per MoE layer (routed and shared partials together), as a dense MLP's: per step two per
    # layer (attention's o_proj, the MLP) and the embedding's.
    c = eng.counter_snapshot()
    assert c["tp_steps"] == c["steps"] and c["tp_allreduces"] == c["steps"] * (2 * cfg.num_layers + 1)


@pytest.mark.parametrize("arch", ["qwen2-moe", "mixtral"])
def test_int8_tp2_tokens_identical_to_tp1(checkpoint_factory, closing, arch):
    """Every expert and the shared expert quantized on each rank's slice, the down projections' per-row scales
    from the whole rows (layers/parallel.py): TP=2 holds TP=1's int8 weights, and in float32 only the order of
    the final sums differs."""
    path = checkpoint_factory(arch)
    expected = tokens(engine(path, 1, quantization="int8"))
    llm = closing(path, 2, quantization="int8")
    for moe in sparse_layers(llm):
        mlps = list(moe.experts) + ([moe.shared_expert] if moe.shared_expert is not None else [])
        assert all(m.gate_up_proj.quant_method is not None and m.down_proj.quant_method is not None for m in mlps)
        assert moe.kernel is not None
    assert tokens(llm) == expected


def test_prequantized_int8_tp2_tokens_identical_to_tp1(checkpoint_factory, closing, tmp_path):
    """A `leverlab quantize` int8 folder: each expert's qweight and whole-row scales cut along their dimensions."""
    from leverlab.models.quantize import quantize_folder

    pre = quantize_folder(checkpoint_factory("qwen2-moe"), tmp_path / "int8", "int8")
    expected = tokens(engine(pre, 1))
    assert tokens(closing(pre, 2)) == expected


def test_int4_tp2_identical_to_tp1(checkpoint_factory, closing):
    """Experts 64 wide, groups of 32 inputs: a rank's half of a down projection is whole groups, so each rank
    quantizes exactly TP=1's groups; only the order of the final sums differs."""
    path = checkpoint_factory("qwen3-moe", moe_intermediate_size=64)
    expected = tokens(engine(path, 1, quantization="int4-g32"))
    assert tokens(closing(path, 2, quantization="int4-g32")) == expected


def test_ngram_speculation_at_tp2_changes_no_token(checkpoint_factory, closing):
    """Verification spans route and reduce like any other step."""
    path = checkpoint_factory("mixtral")
    prompts = [[5, 6, 7, 8] * 6, [9, 10] * 9 + [11], list(range(30, 60))]
    expected = tokens(engine(path, 1), prompts)
    sc = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = closing(path, 2, speculative_config=sc)
    assert tokens(llm, prompts) == expected
    assert llm.engine.counter_snapshot()["spec_accepted_tokens"] > 0


def test_refuses_experts_that_do_not_split(checkpoint_factory):
    """Checked before any rank starts, with the numbers."""
    path = checkpoint_factory("qwen2-moe", moe_intermediate_size=33, shared_expert_intermediate_size=66)
    with pytest.raises(UnsupportedLever, match="moe_intermediate_size 33 .* is not divisible by 2"):
        engine(path, 2)


def test_int4_groups_off_a_ranks_slice_are_refused(checkpoint_factory):
    """Experts 32 wide: a rank's down projection reads 16 inputs, less than a group of 32."""
    msg = "tensor-parallel-size 2 with int4, on each rank's slice: .*in_features 16 .* group size 32"
    with pytest.raises(UnsupportedLever, match=msg):
        engine(checkpoint_factory("qwen3-moe"), 2, quantization="int4-g32")
