"""EAGLE speculation is lossless: greedy tokens identical to plain decoding (float32); sampled output follows
the target distribution; the target's and the head's KV blocks are all free afterwards, through aborts,
preemption, prefix-cache hits and chunked prefill. Also `leverlab train-eagle` end to end on a tiny target."""

import collections
import json

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.cli import main
from leverlab.models.config import ModelConfig
from leverlab.speculative.eagle3_format import load_head
from tests.checkpoints import make_eagle_head as random_head
from tests.engine.helpers import assert_all_free

PROMPTS = [[5, 6, 7, 8] * 6, list(range(30, 60)), [9, 10] * 9 + [11], [3] * 5, list(range(100, 104)) * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)


def spec(head: str, k: int = 3, **extra) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def target(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module")
def trained_head(target, tmp_path_factory):
    """`leverlab train-eagle` for 80 steps (~10 s) on the tiny target: it learns the target's loops, so its
    drafts are often accepted (and still sometimes rejected). A step budget, not a time budget: on a loaded
    machine a time budget had trained too few steps for any draft to be accepted under a random gate."""
    work = tmp_path_factory.mktemp("eagle")
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(["def add(a, b):", "for i in range(10):", "class Point:", "import os",
                                  "Hello, world!", "The quick brown fox"] * 8) + "\n")
    out = work / "head"
    rc = main(["train-eagle", "--model", target, "--out", str(out), "--work-dir", str(work / "run"),
               "--prompts", str(prompts), "--max-steps", "80", "--gen-tokens", "40", "--seq-len", "32",
               "--batch-size", "4", "--threads", "1", "--dtype", "float32", "--eval-prompts", "2",
               "--eval-tokens", "16", "--num-prompts", "40", "--lr", "3e-3", "--ckpt-minutes", "10"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, dtype="float32").generate(PROMPTS, GREEDY)



def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_train_eagle_writes_a_loadable_head_folder(trained_head, target):
    names = {p.name for p in trained_head.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "eval.json"} <= names
    cfg = json.loads((trained_head / "config.json").read_text())
    tcfg = ModelConfig.from_folder(target)
    assert cfg["architectures"] == ["LeverLabEagleHead"] and cfg["target_num_layers"] == tcfg.num_layers
    assert cfg["aux_layer_ids"] == [0, 1] and cfg["vocab_size"] == tcfg.vocab_size
    head = load_head(trained_head, torch.float32)
    # The target's embedding and lm_head are shared, never stored in the head folder.
    assert not any("embed_tokens" in n or "lm_head" in n for n in head.state_dict())
    assert head.fc.weight.shape == (tcfg.hidden_size, 2 * tcfg.hidden_size)
    card = (trained_head / "README.md").read_text()
    assert "acceptance" in card and "leverlab train-eagle" in card
    figures = json.loads((trained_head / "eval.json").read_text())["measured"]
    assert 0 <= figures["acceptance"] <= 1 and len(figures["per_position"]) == 3
    spec = json.loads((trained_head / "speculators" / "config.json").read_text())  # the export for vLLM
    assert spec["speculators_model_type"] == "eagle3" and spec["eagle_aux_hidden_state_layer_ids"] == [1, 2]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_identical_with_a_random_head(checkpoint_factory, tmp_path, arch):
    path = checkpoint_factory(arch)
    base = LLM(path, dtype="float32").generate(PROMPTS, GREEDY)
    llm = LLM(path, dtype="float32", speculative_config=spec(random_head(path, tmp_path / "head")))
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == tokens(base)
    assert llm.engine.counter_snapshot()["spec_draft_tokens"] > 0
    assert_all_free(llm)


def test_greedy_identical_with_a_trained_head(target, trained_head, plain):
    llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head), k=4))
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == tokens(plain)
    for a, b in zip(outs, plain):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    c = llm.engine.counter_snapshot()
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"], "the test should see acceptance and rejection"
    assert c["spec_accepted_pos_0"] >= c["spec_accepted_pos_1"] >= c["spec_accepted_pos_3"]
    assert_all_free(llm)


def test_adaptive_k_with_eagle_is_lossless(target, trained_head, plain):
    llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head), adaptive=True))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(plain)
    assert_all_free(llm)


def test_gate_switching_arms_at_random_stays_lossless(target, trained_head, plain):
    """The gate opening and shutting at random: the head sees features with gaps (no capture while shut)
    and keeps drafting over the rows it has; output stays the target's, blocks all free."""
    import random

    llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head), adaptive=True))
    rng = random.Random(5)
    gate = llm.engine.spec.gate
    gate.decide = lambda n: rng.random() < 0.5
    gate.capture_next = lambda n: rng.random() < 0.5
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(plain)
    c = llm.engine.counter_snapshot()
    assert c["spec_gate_spec_steps"] > 0 and c["spec_gate_plain_steps"] > 0
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"]
    assert_all_free(llm)


def test_disable_by_batch_size_switches_feature_capture_off_and_back_on(target, trained_head):
    llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head), disable_by_batch_size=2))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    before = llm.engine.counter_snapshot()["spec_draft_tokens"]
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.counter_snapshot()["spec_draft_tokens"] > before
    assert llm.engine.runner.model.aux_layers == llm.engine.runner.aux_layers
    assert_all_free(llm)


def test_blocks_free_through_preemption_chunking_prefix_hits_and_aborts(target, trained_head):
    long_prompts = [list(range(5, 5 + n)) for n in (3, 40, 17, 1, 70, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = LLM(target, dtype="float32", max_num_seqs=1)
    want = [alone.generate([p], params)[0].outputs[0].token_ids for p in long_prompts]
    cases = {"preemption": dict(num_kv_blocks=24, block_size=4), "chunked": dict(max_num_batched_tokens=16)}
    for name, kw in cases.items():
        llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head)), **kw)
        outs = llm.generate(long_prompts, params)
        assert tokens(outs) == want, name
        if name == "preemption":
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
        assert_all_free(llm)
    # Prefix-cache hits: the same 40-token prefix twice; the second request skips the cached blocks and the
    # head starts its context after them. Then aborts mid-decode.
    llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head)))
    prefix = list(range(20, 60))
    first = llm.generate([prefix + [1]], params)
    second = llm.generate([prefix + [2], prefix + [1]], params)
    assert second[1].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert llm.engine.counter_snapshot()["prefix_cache_hits"] >= 64
    eng = llm.engine
    for i, p in enumerate(long_prompts):
        eng.add_request(f"a{i}", p, params)
    for _ in range(6):
        eng.step()
    for i in range(0, len(long_prompts), 2):
        eng.abort_request(f"a{i}")
    while eng.has_unfinished():
        eng.step()
    assert eng.counter_snapshot()["spec_draft_tokens"] > 0
    assert_all_free(llm)


def test_sampled_output_follows_the_target_distribution(target, tmp_path):
    """The second output token is emitted by verification (the head drafted it, or the residual was sampled):
    its frequencies, given the most frequent first token, must match the target's distribution."""
    from transformers import AutoModelForCausalLM

    prompt = [9, 10] * 9 + [11]
    n = 3000
    llm = LLM(target, dtype="float32", max_num_seqs=256, max_num_batched_tokens=8192,
              speculative_config=spec(random_head(target, tmp_path / "head", seed=3), k=2))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params)]
    c = llm.engine.counter_snapshot()
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"], "acceptance and residual sampling both needed"
    x0 = collections.Counter(o[0] for o in outs).most_common(1)[0][0]
    seconds = collections.Counter(o[1] for o in outs if o[0] == x0)
    m = sum(seconds.values())
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([prompt + [x0]])).logits[0, -1].double(), dim=-1)
    freq = torch.zeros_like(p)
    for tok, cnt in seconds.items():
        freq[tok] = cnt / m
    # Every frequency within 4.5 standard errors of p (plus a little slack for tiny p).
    bound = 4.5 * torch.sqrt(p * (1 - p) / m) + 2.0 / m
    assert m > 500 and torch.all((freq - p).abs() < bound), (m, (freq - p).abs().max())
    assert_all_free(llm)


def test_eagle_config_checks(target, tmp_path):
    from leverlab.errors import UnsupportedLever

    with pytest.raises(UnsupportedLever, match="no config.json"):
        LLM(target, dtype="float32", speculative_config=spec(str(tmp_path / "missing")))
    with pytest.raises(UnsupportedLever, match="not an EAGLE head"):
        LLM(target, dtype="float32", speculative_config=spec(target))
    with pytest.raises(UnsupportedLever, match="quantization 'fp4' is not one of"):
        LLM(target, dtype="float32", speculative_config=spec(str(tmp_path), quantization="fp4"))
    with pytest.raises(UnsupportedLever, match="no weights to quantize"):
        LLM(target, dtype="float32", speculative_config={"method": "ngram", "quantization": "int8"})


def _recording_drafts(llm) -> list:
    """Wrap the proposer's propose(): the list it returns fills with every step's drafts."""
    p, seen = llm.engine.proposer, []
    propose = p.propose

    def wrapped(seqs, ks):
        drafts = propose(seqs, ks)
        seen.append([d.tokens for d in drafts])
        return drafts

    p.propose = wrapped
    return seen


def test_fused_head_pass_drafts_as_the_module_path(target, trained_head, plain):
    """The head's pass in one C++ call (speculative/eagle_fused.py) against EagleHead.forward module by module, in
    float32: the same drafts at every step (the catch-up over a whole prompt takes the module path in both)."""
    from leverlab.kernels import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("the C++ kernels are not built here")
    drafts = {}
    for fused in (True, False):
        llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head), k=4))
        assert llm.engine.proposer.fused is not None
        if not fused:
            llm.engine.proposer.fused = None
        drafts[fused] = _recording_drafts(llm)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(plain)
        assert_all_free(llm)
    assert drafts[True] == drafts[False] and any(any(d) for d in drafts[True])


def test_int8_drafting_stays_lossless(target, trained_head, plain):
    """quantization int8: the head's linears and the head it drafts through are int8 (a copy: the target's own
    lm_head is untouched); drafts change, the output does not. float32 keeps the model dtype by default."""
    default = LLM(target, dtype="float32", speculative_config=spec(str(trained_head))).engine.proposer
    assert default.head.qkv_proj.quant_method is None and default.draft_head is default.target.lm_head
    llm = LLM(target, dtype="float32", speculative_config=spec(str(trained_head), quantization="int8"))
    p = llm.engine.proposer
    assert p.head.qkv_proj.quant_method is not None and p.draft_head.quant_method is not None
    assert p.target.lm_head.quant_method is None and p.draft_head is not p.target.lm_head
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(plain)
    assert llm.engine.counter_snapshot()["spec_accepted_tokens"] > 0
    assert_all_free(llm)


@pytest.mark.slow
def test_compiled_forward_with_eagle(target, trained_head, plain, tmp_path, monkeypatch):
    monkeypatch.setenv("LEVERLAB_CACHE", str(tmp_path))
    llm = LLM(target, dtype="float32", execution_mode="compiled", speculative_config=spec(str(trained_head)))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(plain)
    assert llm.engine.counter_snapshot()["spec_accepted_tokens"] > 0


def test_own_embedding_and_lm_head_copy_matches_the_shared_ones(checkpoint_factory, tmp_path):
    """At tensor-parallel size > 1 the head reads its own full copy (the target's are sharded)."""
    from leverlab.models.loader import load_embedding_and_lm_head

    for arch in ("qwen3", "llama"):  # tied and untied output heads
        path = checkpoint_factory(arch)
        llm = LLM(path, dtype="float32", speculative_config=spec(random_head(path, tmp_path / arch)))
        p = llm.engine.proposer
        ids, h = torch.tensor([1, 5, 9]), torch.randn(2, p.head.config.hidden_size)
        shared = p._embed(ids), p._logits(h)
        p.own_weights = load_embedding_and_lm_head(path, p.dtype, p.device)
        assert torch.equal(shared[0], p._embed(ids))
        assert torch.allclose(shared[1], torch.nn.functional.linear(h, p.own_weights[1]).float())
