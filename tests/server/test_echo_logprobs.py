"""Completions `echo` with `logprobs` (lm-evaluation-harness's loglikelihood request) and chat
`prompt_logprobs`, through the real server and the official openai client."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-qwen3"
PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt_rows(client):
    """The prompt's logprobs as vLLM's prompt_logprobs give them: None, then {id: {logprob, ...}} per token."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    c = r.choices[0].model_dump()
    return c["prompt_token_ids"], c["prompt_logprobs"]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_is_the_prompt_then_the_completion(client, max_tokens):
    ids, rows = _prompt_rows(client)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    lp = c.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + max_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for i in range(1, n):
        want = rows[i][str(ids[i])]["logprob"]
        assert lp.token_logprobs[i] == pytest.approx(want, abs=1e-5)
        assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 2  # the token and the top 1
    assert "".join(lp.tokens) == c.text  # text_offset walks the echoed text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert c.text.startswith(PROMPT) and (max_tokens or c.text == PROMPT)
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 1  # as vLLM: max_tokens 0 runs one


def test_lm_eval_loglikelihood_shape(client):
    # lm-eval's local-completions: a context + continuation as one prompt, the continuation's logprobs summed
    # and its greedy check from top_logprobs (the first key must be the most likely)
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "def add(a, b):"], max_tokens=1, temperature=0,
                                  echo=True, logprobs=1, seed=1234)
    assert len(r.choices) == 2 and all(c.logprobs.token_logprobs[0] is None for c in r.choices)
    for c in r.choices:
        assert all(isinstance(x, float) for x in c.logprobs.token_logprobs[1:])


def test_echo_logprobs_streamed_refused_and_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, stream=True)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == PROMPT


def test_chat_prompt_logprobs_at_the_top_level(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 0})
    body = r.model_dump()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == r.usage.prompt_tokens
    assert all(len(row) == 1 for row in body["prompt_logprobs"][1:])
