"""The logits controls (penalties, min_p, logit_bias, bad_words, allowed_token_ids): against a plain
per-row reference on fixed logits (written here from the definitions, loops not tensors), rows without
controls untouched, and through the engine, plain and speculative (token-identical in float32, greedy)."""

import math

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.worker import logits_processors
from leverlab.worker.sampler import probabilities

V = 12


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One row, one token at a time, in vLLM's order (allowed -> bad words -> bias -> penalties)."""
    x = list(row)
    if p.allowed_token_ids:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for word in p.bad_words_token_ids or []:
        n = len(word) - 1
        if n <= len(output) and (n == 0 or output[len(output) - n:] == word[:-1]):
            x[word[-1]] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = output.count(t)
        x[t] -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
    return x


CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=0.6),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(logit_bias={3: 5.0, 7: -200.0}),
    SamplingParams(allowed_token_ids=[1, 4, 9]),
    SamplingParams(),  # no controls: the row must come back bit for bit
]


def _bad_words(p: SamplingParams, words: list[list[int]]) -> SamplingParams:
    p.bad_words_token_ids = words
    return p


def test_batch_matches_the_reference_row_by_row():
    g = torch.Generator().manual_seed(0)
    cases = CASES + [_bad_words(SamplingParams(), [[5], [2, 6], [3, 3, 8]])]
    logits = torch.randn(len(cases), V, generator=g) * 3
    prompts = [[1, 2, 2, 5], [0], [7, 7], [3], [11, 2], [4], [1], [2], [9]]
    outputs = [[2, 2, 3], [4, 4, 4, 0], [7, 1, 1], [3, 3], [2, 6, 6], [], [9], [5], [2, 3, 3]]
    before = logits.clone()
    got = logits_processors.apply(logits, cases, prompts, outputs)
    assert torch.equal(logits, before), "the caller's logits stay raw (logprobs are reported from them)"
    for r, p in enumerate(cases):
        want = torch.tensor(reference(before[r].tolist(), p, prompts[r], outputs[r]))
        torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-6, msg=f"row {r}: {p}")
    assert torch.equal(got[len(CASES) - 1], before[len(CASES) - 1])
    # bad words: 5 alone always; 6 after a 2; 8 after 3, 3
    assert got[-1, 5] == -math.inf and got[-1, 8] == -math.inf and got[-1, 6] != -math.inf


def test_no_controls_no_copy():
    logits = torch.randn(3, V)
    assert logits_processors.apply(logits, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3) is logits


def test_min_p_after_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    p = SamplingParams(temperature=0.5, min_p=0.1)
    probs = probabilities(logits, p)
    soft = torch.softmax(logits / 0.5, dim=-1)
    keep = soft >= 0.1 * soft.max()
    want = torch.where(keep, soft, torch.zeros(())) / soft[keep].sum()
    torch.testing.assert_close(probs, want)


def test_validation_as_vllm():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(min_p=1.5), dict(allowed_token_ids=[]), dict(logit_bias={"x": 1.0}), dict(bad_words=[""]),
                dict(bad_words=["w"] * 1000)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(logit_bias={"5": 300, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}


PROMPTS = [[5, 6, 7, 8] * 6, list(range(30, 60)), [9, 10] * 9 + [11]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3")


def test_engine_applies_them_and_speculation_is_token_identical(path):
    plain = LLM(path, dtype="float32")
    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    ps = [SamplingParams(**base, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
          SamplingParams(**base, logit_bias={7: 4.0}, bad_words=["x"]),
          SamplingParams(**base, allowed_token_ids=list(range(40, 80)), frequency_penalty=2.0)]
    free = plain.generate(PROMPTS, SamplingParams(**base))
    outs = [plain.generate(PROMPTS, p) for p in ps]
    for p, o in zip(ps, outs):
        assert [x.outputs[0].token_ids for x in o] != [x.outputs[0].token_ids for x in free], p
    assert all(40 <= t < 80 for x in outs[2] for t in x.outputs[0].token_ids)
    spec = LLM(path, dtype="float32", speculative_config=NGRAM)
    for p, o in zip(ps, outs):
        got = spec.generate(PROMPTS, p)
        assert [x.outputs[0].token_ids for x in got] == [x.outputs[0].token_ids for x in o], p
    assert spec.engine.counter_snapshot()["spec_accepted_tokens"] > 0, "drafts should be verified"
