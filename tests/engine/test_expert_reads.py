"""The experts a mixture-of-experts decode pass reads, counted by the engine (models/expert_reads.py), against a
reference computed in torch from the router's own choices: a batch of several sequences, so an expert that several
of them chose is read (and counted) once per pass; on the C++ MoeExperts path and on the module path; the bytes are
the fixed weights plus the hit experts at their quantized layout."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.models.config import ModelConfig
from leverlab.models.expert_reads import expert_bytes, fixed_bytes, linear_bytes
from leverlab.models.moe import SparseMoE

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [100, 3, 250, 17, 9, 31, 2, 8], list(range(5, 35)), [9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def sparse_layers(llm) -> list[SparseMoE]:
    return [layer.mlp for layer in llm.engine.runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]


def reference_reads(llm, prompts, params):
    """Generate, recording each router's choices; returns (decode passes, distinct experts summed over layers and
    passes, bytes those passes read, whether some pass saw an expert chosen by two sequences), computed from the
    choices with torch.unique, a pass being decode when each of its sequences brings one token (and its drafts)."""
    runner = llm.engine.runner
    moes = sparse_layers(llm)
    chosen: list[tuple[SparseMoE, torch.Tensor]] = []
    hooks = [m.gate.register_forward_hook(lambda g, i, out, m=m: chosen.append((m, out[1].clone()))) for m in moes]
    passes, experts, read, shared = 0, 0, 0, False
    execute = runner.execute

    def recording(batch):
        nonlocal passes, experts, read, shared
        chosen.clear()
        out = execute(batch)
        # decode or verification: each sequence brings its last token and its drafts, and samples them all
        if all(n == 1 + len(seq.spec_token_ids) for seq, n in zip(batch.seqs, batch.num_new_tokens)):
            assert [m for m, _ in chosen] == moes  # every sparse layer routed once
            passes += 1
            read += fixed_bytes(runner.model)
            for m, c in chosen:
                n = torch.unique(c).numel()
                experts += n
                read += n * expert_bytes(m)
                shared |= n < c.numel()
        return out

    runner.execute = recording
    fused_step, runner.fused = runner.fused, None  # the routers in Python, where the hooks see them (not the C++ step)
    try:
        outs = llm.generate(prompts, params)
    finally:
        runner.execute = execute
        runner.fused = fused_step
        for h in hooks:
            h.remove()
    return outs, passes, experts, read, shared


def counted(llm) -> tuple[float, float, float]:
    c = llm.engine.counter_snapshot()
    assert c["moe_decode_passes_uncounted"] == 0
    return c["moe_decode_passes"], c["moe_experts_read"], c["moe_weight_bytes_read"]


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe"])
def test_counted_experts_match_the_routers_choices(checkpoint_factory, arch):
    llm = LLM(checkpoint_factory(arch), dtype="float32")
    moes = sparse_layers(llm)
    kernel_paths = [True, False] if moes[0].kernel is not None else [False]  # the C++ op where it is built
    saved = [(m.kernel, m.kernel_rows) for m in moes]
    for on in kernel_paths:
        for m, (op, rows) in zip(moes, saved):
            m.kernel, m.kernel_rows = (op, rows) if on else (None, 0)
        before = counted(llm)
        _, passes, experts, read, shared = reference_reads(llm, PROMPTS, GREEDY)
        after = counted(llm)
        assert shared  # 5 sequences x 2 of 8 experts: some pass read an expert for two sequences, counted once
        assert passes >= GREEDY.max_tokens - 1
        assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (passes, experts, read)


def test_verification_passes_count_as_decode_passes(checkpoint_factory):
    """With n-gram speculation a pass verifies a sequence's drafts: its K+1 tokens are sampled rows, the pass is a
    decode pass, and its experts (all its tokens') are counted once each."""
    llm = LLM(checkpoint_factory("qwen3-moe"), dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    repetitive = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    _, passes, experts, read, _ = reference_reads(llm, repetitive, GREEDY)
    assert llm.engine.counter_snapshot()["spec_verify_steps"] > 0
    assert counted(llm) == (passes, experts, read)


def test_one_sequence_reads_top_k_experts_per_layer_as_the_estimate_says(checkpoint_factory):
    """At one sequence each sparse layer reads exactly num_experts_per_tok experts: the measured bytes per pass are
    ModelConfig's active-weight estimate less what it counts that a pass does not read (the untied embedding table)
    plus what it leaves out (the q/k norms)."""
    path = checkpoint_factory("qwen3-moe")
    cfg = ModelConfig.from_folder(path)
    llm = LLM(path, dtype="float32")
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    passes, experts, read = counted(llm)
    assert passes == 8  # the first token comes from the prefill pass
    assert experts == passes * sum(cfg.sparse_layers) * cfg.num_experts_per_tok
    qk_norms = cfg.num_layers * 2 * cfg.head_dim
    expected = cfg.weight_bytes(4) - 4 * cfg.vocab_size * cfg.hidden_size + 4 * qk_norms
    assert read / passes == expected


def test_quantized_experts_count_their_kernel_layout(checkpoint_factory):
    """Under int8 an expert's bytes are those its kernels read (int8 weights and scales), about a quarter of
    float32's; the counted bytes use them."""
    path = checkpoint_factory("qwen3-moe")
    f32 = LLM(path, dtype="float32")
    i8 = LLM(path, dtype="float32", quantization="int8")
    m32, m8 = sparse_layers(f32)[0], sparse_layers(i8)[0]
    e = m8.experts[0]
    assert expert_bytes(m8) == linear_bytes(e.gate_up_proj) + linear_bytes(e.down_proj)
    assert 0.2 < expert_bytes(m8) / expert_bytes(m32) < 0.35
    _, passes, experts, read, _ = reference_reads(i8, PROMPTS[:3], GREEDY)
    assert counted(i8) == (passes, experts, read)


def test_a_dense_model_reports_no_expert_counters(checkpoint_factory):
    llm = LLM(checkpoint_factory("qwen3"), dtype="float32")
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert not any(k.startswith("moe_") for k in llm.engine.counter_snapshot())


def test_a_pass_with_a_layer_out_of_sight_is_left_out_whole(checkpoint_factory):
    """A decode pass in which some sparse layer did not report its choices (as a fused C++ step that routes out of
    Python's sight would) is not counted at all, so bytes per pass never mix counted and uncounted layers; a path
    that counts its own hits reports them through record_hits."""
    llm = LLM(checkpoint_factory("qwen3-moe"), dtype="float32")
    moes = sparse_layers(llm)
    reads = moes[0].reads
    llm.engine.runner.fused = None  # the module path, where each layer reports its own choices (the fused step
    # reports every layer's at once: test_moe_fused.py)
    moes[1].reads = None  # layer 1 stops reporting
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    c = llm.engine.counter_snapshot()
    assert (c["moe_decode_passes"], c["moe_experts_read"], c["moe_decode_passes_uncounted"]) == (0, 0, 4)
    reads.begin(decode=True)
    for m in moes:
        reads.record_hits(m, 3)
    reads.end()
    assert (reads.passes, reads.experts, reads.bytes) == (1, 9, reads.fixed + 3 * sum(reads.per_expert.values()))
