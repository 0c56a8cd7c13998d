"""Sampling parameters and outputs: seeds, top-k/top-p, stops, min/max tokens, logprobs, errors."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.errors import RequestError

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    return LLM(checkpoint_factory("qwen3"), dtype="float32")


@pytest.fixture(scope="module")
def hf(checkpoint_factory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3"), dtype=torch.float32).eval()


def gen(llm, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0]


def test_seed_reproducible_alone_and_batched(llm):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    batched = llm.generate([[1, 2], PROMPT, [9] * 30], [SamplingParams(temperature=0.8, max_tokens=9), p, p])
    assert batched[1].outputs[0].token_ids == alone
    other = gen(llm, temperature=1.0, seed=8, max_tokens=20, ignore_eos=True).outputs[0].token_ids
    assert other != alone


def test_top_k_1_is_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=16, ignore_eos=True).outputs[0].token_ids
    assert gen(llm, temperature=1.5, top_k=1, seed=1, max_tokens=16, ignore_eos=True).outputs[0].token_ids == greedy
    assert gen(llm, temperature=1.0, top_p=1e-6, seed=1, max_tokens=16, ignore_eos=True).outputs[0].token_ids == greedy


def test_n_outputs(llm):
    out = gen(llm, n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_token_and_string(llm):
    base = gen(llm, temperature=0, max_tokens=30, ignore_eos=True).outputs[0]
    stop_tok = base.token_ids[6]
    first = base.token_ids.index(stop_tok)
    out = gen(llm, temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok]).outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # min_tokens forbids the stop token until enough tokens are out.
    held = gen(llm, temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok],
               min_tokens=first + 3).outputs[0]
    assert len(held.token_ids) >= first + 3 and stop_tok not in held.token_ids[: first + 3]
    # A stop string cuts the text before it (and the text never contains it).
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = gen(llm, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]).outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = gen(llm, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_streamed_text_only_grows_and_matches(llm):
    texts = [o.outputs[0].text for o in llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zzz"]))]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == gen(llm, temperature=0, max_tokens=20, ignore_eos=True).outputs[0].text


def test_logprobs_match_transformers(llm, hf):
    out = gen(llm, temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    o = out.outputs[0]
    ids = PROMPT + o.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert abs(lp[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(lp) and len(lp) <= 4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        assert abs(out.prompt_logprobs[pos][PROMPT[pos]].logprob - ref[pos - 1, PROMPT[pos]].item()) < 1e-4


def test_bad_requests_say_what_to_fix(llm):
    with pytest.raises(RequestError, match="empty"):
        gen(llm, prompt="")
    with pytest.raises(RequestError, match=r"maximum context length is 512 tokens.*600"):
        gen(llm, prompt=[1] * 100, max_tokens=500)
    with pytest.raises(RequestError, match="token ids"):
        gen(llm, prompt=[1, 10**6])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert not llm.engine.requests and llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
