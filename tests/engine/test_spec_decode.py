"""Speculative decoding is lossless: greedy tokens identical to plain decoding (float32); sampled output
follows the target distribution; KV blocks all free afterwards."""

import collections
import random

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.core.sequence import Sequence
from leverlab.errors import UnsupportedLever
from leverlab.speculative.ngram import NgramProposer
from leverlab.speculative.verify import verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts give the n-gram proposer something to find; varied lengths mix prefill and decode.
PROMPTS = [[5, 6, 7, 8] * 6, list(range(30, 60)), [9, 10] * 9 + [11], [3] * 5, list(range(100, 104)) * 3]


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3")


def draft_config(checkpoint_factory):
    # A different random model with the same tokenizer: it agrees with the target only sometimes, which
    # exercises acceptance and rejection alike.
    return {"method": "draft_model", "model": checkpoint_factory("qwen3", num_hidden_layers=1),
            "num_speculative_tokens": 3}


@pytest.mark.parametrize("arch,method", [("qwen3", "ngram"), ("llama", "ngram"), ("qwen3", "draft_model"),
                                         ("llama", "draft_model")])
def test_greedy_identical_to_plain_decoding(checkpoint_factory, arch, method):
    path = checkpoint_factory(arch)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    plain = LLM(path, dtype="float32").generate(PROMPTS, params)
    sc = NGRAM if method == "ngram" else draft_config(checkpoint_factory)
    if method == "draft_model" and arch == "qwen3":
        sc = {**sc, "model": path}  # the target as its own draft: every draft is accepted
    spec = LLM(path, dtype="float32", speculative_config=sc)
    outs = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(outs, plain):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    c = spec.engine.counter_snapshot()
    assert c["spec_draft_tokens"] > 0 and c["spec_accepted_tokens"] > 0, "the test should exercise acceptance"
    assert spec.engine.blocks.num_free == spec.engine.blocks.num_blocks
    spec.engine.check_invariants()
    if method == "draft_model":
        draft_blocks = spec.engine.proposer.blocks
        assert draft_blocks.num_free == draft_blocks.num_blocks and not spec.engine.proposer.shadows
        if arch == "qwen3":
            assert c["spec_accepted_tokens"] == c["spec_draft_tokens"]


def test_draft_model_sampling_reproducible_and_lossless_in_distribution(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    spec = LLM(path, dtype="float32", speculative_config=draft_config(checkpoint_factory))
    p = SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
    a = spec.generate(PROMPTS[:2], p)
    b = spec.generate(PROMPTS[:2], p)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_disable_by_batch_size(path):
    llm = LLM(path, dtype="float32", speculative_config={**NGRAM, "disable_by_batch_size": 2})
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    batch_drafts = llm.engine.counter_snapshot()["spec_draft_tokens"]
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.counter_snapshot()["spec_draft_tokens"] > batch_drafts


def test_stops_and_limits_hold_under_speculation(path):
    plain = LLM(path, dtype="float32")
    spec = LLM(path, dtype="float32", speculative_config=NGRAM)
    base = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))[0].outputs[0]
    stop_tok = base.token_ids[9]
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=[stop_tok])):
        a = plain.generate([PROMPTS[0]], params)[0].outputs[0]
        b = spec.generate([PROMPTS[0]], params)[0].outputs[0]
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)


def test_ngram_proposer_finds_latest_match():
    seq = Sequence(0, "r", 0, [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], SamplingParams(), None)
    assert NgramProposer(1, 3).propose([seq], [2])[0].tokens == [7, 8]
    assert NgramProposer(2, 3).lookup([4, 5, 6], 2) == []


def test_rejection_sampling_follows_target_distribution():
    # Target distribution p over 4 tokens; drafts always propose token 2 (a point mass, as n-gram does).
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(p).repeat(2, 1)  # [k + 1, V] with k = 1
    seq = Sequence(0, "r", 0, [1], SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    n = 20000
    first = collections.Counter(verify(seq, logits, [2])[0] for _ in range(n))
    freq = torch.tensor([first[i] / n for i in range(4)])
    # Chi-square style bound: every frequency within 4 standard errors of p.
    assert torch.all((freq - p).abs() < 4 * torch.sqrt(p * (1 - p) / n)), freq


def test_speculative_config_is_checked():
    from leverlab.config import EngineConfig

    EngineConfig(model="x", speculative_config={"method": "eagle", "model": "h"})  # built (tests/engine/test_eagle.py)
    with pytest.raises(UnsupportedLever, match="needs \"model\""):
        EngineConfig(model="x", speculative_config={"method": "eagle"})
    with pytest.raises(UnsupportedLever, match="needs \"model\""):
        EngineConfig(model="x", speculative_config={"method": "draft_model"})
    with pytest.raises(UnsupportedLever, match="unknown keys"):
        EngineConfig(model="x", speculative_config={"method": "ngram", "k": 3})


def test_adaptive_is_lossless_too(path):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(path, dtype="float32").generate(PROMPTS, params)
    outs = LLM(path, dtype="float32", speculative_config={**NGRAM, "adaptive": True}).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_gate_runs_the_faster_arm_per_batch_size_and_keeps_probing():
    from leverlab.speculative.gate import ThroughputGate

    g = ThroughputGate(needs_capture=True)
    # Alone, speculating emits 2.5 tokens per 1.2 plain-step times; at 16 sequences it emits 20 per 1.6.
    speed = {1: {True: 2.5 / 1.2, False: 1.0}, 16: {True: 20 / 1.6, False: 16.0}}
    picks = {1: [], 16: []}
    rng = random.Random(0)
    for _ in range(600):
        for n in (1, 16):
            arm = g.decide(n)
            picks[n].append(arm)
            # One step in 20 takes 5x as long (another process had the core): the decision must not follow it.
            seconds = 5.0 if rng.random() < 0.05 else 1.0
            if not arm and g.capture_next(n):  # as the decoder does: a capturing plain step is not the plain arm
                g.observe_capture(n, seconds)
            else:
                g.observe_step(n, arm, tokens=round(speed[n][arm] * 100), seconds=seconds)
    late = {n: picks[n][100:] for n in picks}
    assert sum(late[1]) / len(late[1]) > 0.9  # mostly speculating where it pays
    assert sum(late[16]) / len(late[16]) < 0.1  # mostly plain where it does not
    assert any(late[16]), "the losing arm is still probed now and then (acceptance stays fresh)"
    rates = g.rates()
    assert rates[1][0] > rates[1][1] and rates[16][0] < rates[16][1]  # (buckets: 1 and 16 sequences)
    # where speculating wins, the plain probes are measured too (their steps do not capture features, bar the
    # last, which captures for the speculating steps after it)
    assert g.buckets[1].arms[False].samples >= 4 + 3 * 4  # the first tries, then 3 of each probe run of 4
    # capture_next (asked after this step's decision) looks ahead: the LEAD steps before a speculating run
    # capture features for it (EAGLE), and the other plain steps do not.
    g2 = ThroughputGate(needs_capture=True)
    arms, captures = [], []
    for _ in range(400):
        arm = g2.decide(16)
        arms.append(arm)
        captures.append(g2.capture_next(16))
        g2.observe_step(16, arm, tokens=round(speed[16][arm] * 100), seconds=1.0)
    for i in range(len(arms) - 1):
        if arms[i + 1]:
            assert captures[i], i  # the step before a speculating one captured
    assert 0 < sum(captures[100:]) <= 0.25 * len(captures[100:])  # mostly shut at 16: captures are rare
    assert ThroughputGate(needs_capture=False).capture_next(4) is False


def test_gate_measures_a_skewed_yield_by_its_total():
    """An n-gram arm's yield per step is skewed: most steps accept nothing, a few accept K. Speculating here emits
    1 token on 60% of its steps and 6 on the rest (3 a step on average) against plain decoding's 2, at the same
    step time: it wins, though its median step emits less than a plain one. The gate must see it win."""
    from leverlab.speculative.gate import ThroughputGate

    shares = []
    for seed in range(6):
        g = ThroughputGate(needs_capture=False)
        rng = random.Random(seed)
        picks = []
        for _ in range(600):
            arm = g.decide(4)
            picks.append(arm)
            tokens = (6 if rng.random() < 0.4 else 1) if arm else 2
            g.observe_step(4, arm, tokens, seconds=1.0)
        spec, plain = g.rates()[4]
        assert spec > plain == 2.0, seed  # (a median of per-step rates read it as 1 token a step)
        shares.append(sum(picks[100:]) / 500)
    # An unlucky start can keep it plain for a few hundred steps (probes of 4 steps refill a 64-step window
    # slowly), but not for long.
    assert sum(shares) / len(shares) > 0.85 and min(shares) > 0.4, shares


def test_gate_takes_a_second_look_after_an_unrepresentative_start():
    """A bucket's first tries run where its requests' outputs begin, which can be unlike the rest: here the
    speculating arm emits 1 token a step on its first 4 steps (the bundled EAGLE head's first drafts of an output
    are all rejected), 3 afterwards, at 1.5 plain steps' time (2x plain decoding). The gate must look again soon,
    with that arm measured afresh, and speculate from then on; it had followed plain decoding until its first
    probe at decision 78, and then kept the first tries in the arm's window."""
    from leverlab.speculative.gate import ThroughputGate

    g = ThroughputGate(needs_capture=False)
    picks, spec_steps = [], 0
    for _ in range(160):
        arm = g.decide(1)
        picks.append(arm)
        spec_steps += arm
        g.observe_step(1, arm, (1 if spec_steps <= 4 else 3) if arm else 1, 1.5 if arm else 1.0)
    assert sum(picks[40:]) / len(picks[40:]) > 0.9, picks


def test_a_new_batch_size_starts_from_its_neighbours_better_arm_where_that_carries_over():
    """A bucket that has measured both arms is the prior of a new one where its verdict carries over (speculating
    pays less with more sequences): plain decoding that won at 1 sequence at a burst of 16, speculating that won
    at 16 at a burst of 1. The burst runs the neighbour's better arm from its first step and tries the other only
    after a wait set by the neighbour's margin, so a short burst is not split between the arms; where the prior
    is wrong for the new size, the measurements still win. Speculating that won at 1 sequence says less about
    16: that burst starts speculating too but tries plain decoding after the shortest wait."""
    from leverlab.speculative.gate import ThroughputGate

    def burst(g, n, spec_speed, steps):
        picks = []
        for _ in range(steps):
            arm = g.decide(n)
            picks.append(arm)
            g.observe_step(n, arm, tokens=round((spec_speed if arm else 1.0) * n * 10), seconds=1.0)
        return picks

    # (first size, speculating's speed there, burst size, speculating's speed there)
    for n0, s0, n1, s1 in ((1, 0.5, 16, 0.5), (1, 0.5, 16, 1.5), (16, 1.5, 1, 2.0), (16, 1.5, 1, 0.5)):
        g = ThroughputGate(needs_capture=False)
        burst(g, n0, s0, 200)
        picks = burst(g, n1, s1, 300)
        assert all(a == (s0 > 1) for a in picks[:40]), (n0, s0, n1, s1, picks[:40])  # no even split at the start
        want = s1 > 1
        assert sum(a == want for a in picks[150:]) / 150 > 0.9, (n0, s0, n1, s1, picks)
    g = ThroughputGate(needs_capture=False)
    burst(g, 1, 2.0, 200)
    picks = burst(g, 16, 0.5, 300)
    first_plain = picks.index(False)  # a run of plain decoding, at the shortest wait
    assert first_plain == g.SECOND_LOOK - 1 and not any(picks[first_plain : first_plain + g.RUN]), picks[:24]
    assert sum(not a for a in picks[40:]) / len(picks[40:]) > 0.9


def test_each_batch_size_up_to_16_is_measured_apart():
    """A c=8 wave that speculates now and then goes ragged: some steps run 7 sequences. Here plain decoding wins
    at 8 (8 tokens a step against 9 in 1.2x the time) and speculating at 7 (10 against 7): the gate must find
    both, which a bucket pooling 6-11 sequences could not (one decision for both sizes)."""
    from leverlab.speculative.gate import ThroughputGate

    g = ThroughputGate(needs_capture=False)
    assert [g.bucket_of(n) for n in (0, 1, 2, 7, 8, 16)] == [1, 1, 2, 7, 8, 16]
    keys = [g.bucket_of(n) for n in range(16, 65)]
    assert keys == sorted(keys) and g.bucket_of(17) > 16 and len(set(keys)) == 9  # 16, then 8 quarter octaves to 64
    picks = {7: [], 8: []}
    for i in range(900):
        n = 7 if i % 3 == 0 else 8
        arm = g.decide(n)
        picks[n].append(arm)
        tokens, seconds = {(8, True): (9, 1.2), (8, False): (8, 1.0), (7, True): (10, 1.0), (7, False): (7, 1.0)}[n, arm]
        g.observe_step(n, arm, tokens, seconds)
    assert sum(picks[8][200:]) / len(picks[8][200:]) < 0.15, picks[8][200:]
    assert sum(picks[7][100:]) / len(picks[7][100:]) > 0.85, picks[7][100:]


def test_gate_probes_a_far_losing_arm_seldom():
    """Probing costs about BUDGET of the time, as measured: a speculating arm at half the plain rate (and the
    plain steps that capture features for it, 1.3x a plain step) is probed far less often than one close
    behind, but still probed."""
    from leverlab.speculative.gate import BUDGET, ThroughputGate

    def run(spec_rate: float, steps: int = 3000) -> tuple[float, list[bool]]:
        g = ThroughputGate(needs_capture=True)
        arms, spent, lost = [], 0.0, 0.0
        for _ in range(steps):
            arm = g.decide(2)
            captures = g.capture_next(2)
            arms.append(arm)
            seconds = 2.0 / spec_rate * 2.5 if arm else 1.3 if captures else 1.0  # plain: 2 tokens a second
            tokens = 5 if arm else 2
            if arm or captures:
                lost += seconds - tokens / 2.0  # against emitting the same tokens plainly
            spent += seconds
            if captures and not arm:
                g.observe_capture(2, seconds)
            else:
                g.observe_step(2, arm, tokens, seconds)
        return lost / spent, arms

    far_loss, far = run(1.0)  # speculating: 1 token a second, half the plain rate
    near_loss, near = run(1.8)  # 0.9x the plain rate
    late_far, late_near = sum(far[200:]), sum(near[200:])
    assert 0 < late_far < late_near / 3  # the far loser is still probed, and much less often
    assert far_loss < 2.5 * BUDGET  # exploration of the new bucket included
    assert near_loss < 2.5 * BUDGET


def test_shut_gate_costs_what_a_plain_step_costs(checkpoint_factory, tmp_path):
    """Gate held shut: no drafts, no aux output from the runner, no features handed to the head."""
    from tests.checkpoints import make_eagle_head

    path = checkpoint_factory("qwen3")
    head = make_eagle_head(path, tmp_path / "head")
    llm = LLM(path, dtype="float32", speculative_config={"method": "eagle", "model": head, "adaptive": True})
    eng = llm.engine
    gate, prop = eng.spec.gate, eng.proposer
    gate.decide = lambda n: False
    gate.capture_next = lambda n: False
    seen = []
    inner = prop.observe
    prop.observe = lambda result: (seen.append(result), inner(result))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    plain = LLM(path, dtype="float32").generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    c = eng.counter_snapshot()
    assert c["spec_draft_tokens"] == 0 and c["spec_gate_plain_steps"] > 0 and c["spec_gate_spec_steps"] == 0
    assert eng.runner.model.aux_layers == () and not seen
