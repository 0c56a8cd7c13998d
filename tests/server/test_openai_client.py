"""The real server through the official `openai` client: what an OpenAI user does, answered correctly."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "tiny-qwen3"  # the checkpoint folder's name is the default served name
EXACT = {"ignore_eos": True}  # benchmarks need exact lengths: the random model may emit EOS early


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_exact_length_and_usage(client):
    r = client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=7, temperature=0, extra_body=EXACT
    )
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7 and r.usage.prompt_tokens > 0


def test_greedy_is_deterministic_and_seed_reproduces(client):
    kw = dict(model=MODEL, prompt="for i in range(10):", max_tokens=12, extra_body=EXACT)
    a = client.completions.create(temperature=0, **kw).choices[0].text
    b = client.completions.create(temperature=0, **kw).choices[0].text
    assert a == b
    s1 = client.completions.create(temperature=1.0, seed=1234, **kw).choices[0].text
    s2 = client.completions.create(temperature=1.0, seed=1234, **kw).choices[0].text
    assert s1 == s2


def test_token_id_prompt_equals_text_prompt(client, checkpoint):
    from transformers import AutoTokenizer

    text = "class Point:"
    ids = AutoTokenizer.from_pretrained(str(checkpoint)).encode(text)
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body=EXACT)
    r_text = client.completions.create(prompt=text, **kw)
    r_ids = client.completions.create(prompt=ids, **kw)
    assert r_ids.usage.prompt_tokens == len(ids) == r_text.usage.prompt_tokens
    assert r_ids.choices[0].text == r_text.choices[0].text


def test_batch_of_prompts_gets_choices_for_each(client):
    r = client.completions.create(model=MODEL, prompt=["hello", "def f"], max_tokens=3, n=2, extra_body=EXACT)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12


def test_n_greater_than_one(client):
    r = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=5, n=3, temperature=1.0, seed=7, extra_body=EXACT
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body=EXACT)
    full = client.completions.create(**kw).choices[0].text
    stop = next(
        (
            full[i : i + 2]
            for i in range(3, len(full) - 2)
            if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
        ),
        None,
    )
    if stop is None:
        pytest.skip(f"no usable stop string in {full!r}")
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_min_tokens_passes_through(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=6, extra_body={"min_tokens": 6})
    assert r.usage.completion_tokens == 6


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, logprobs=3, temperature=0, extra_body=EXACT
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-4)



def test_prompt_logprobs_and_token_ids_match_the_engine(client, checkpoint):
    """vLLM's prompt_logprobs / return_tokens_as_token_ids extensions, checked against the Python API."""
    from leverlab import LLM, SamplingParams

    prompt = "def add(a, b):\n    return a + b"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
        extra_body={**EXACT, "prompt_logprobs": 2, "return_tokens_as_token_ids": True},
    )
    choice = r.choices[0].model_dump()
    ref = LLM(str(checkpoint), dtype="float32", execution_mode="eager").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2))[0]
    assert choice["prompt_token_ids"] == ref.prompt_token_ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.outputs[0].token_ids]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ref.prompt_token_ids) and plp[0] is None
    for pos, (got, want, tid) in enumerate(zip(plp[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])):
        assert set(got) == {str(t) for t in want}, pos  # the prompt's own token and the top 2
        assert got[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-5)
        # the prompt's own token has its rank in the whole vocabulary (vLLM's), whether or not in the top 2
        assert got[str(tid)]["rank"] == ref.prompt_ranks[pos + 1] >= 1, pos
        ranks = sorted(e["rank"] for e in got.values())
        assert ranks[:2] == [1, 2] and len(ranks) == len(got)
        best = max(got.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and best["decoded_token"].startswith("token_id:")


def test_prompt_logprobs_refused_when_streaming(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "prompt_logprobs" in r.text
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "prompt_logprobs": 99}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]

def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        extra_body=EXACT,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        extra_body=EXACT,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_chat_without_max_tokens_fills_the_context(client, server):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0, extra_body=EXACT
    )
    assert r.usage.total_tokens == 512 and r.choices[0].finish_reason == "length"


def _stream_text(stream):
    texts, finishes, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason:
                finishes.setdefault(ch.index, []).append(ch.finish_reason)
    return texts, finishes, chunks


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0, n=2, extra_body=EXACT)
    full = client.completions.create(**kw)
    texts, finishes, chunks = _stream_text(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {0: ["length"], 1: ["length"]}  # exactly one finish per choice
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
        extra_body=EXACT,
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    texts, finishes, chunks = _stream_text(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: full} and finishes == {0: ["length"]}
    assert chunks[-1].usage.completion_tokens == 8


def test_stream_ends_with_done_and_carries_timings(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert set(last["timings"]) >= {"tokenize_ms", "queue_ms", "prefill_ms", "decode_ms", "detokenize_ms"}


def test_non_stream_timings_add_up(server):
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 6, "ignore_eos": True}, timeout=60
    ).json()
    t = r["timings"]
    assert all(t[k] >= 0 for k in ("tokenize_ms", "queue_ms", "prefill_ms", "decode_ms", "detokenize_ms"))
    assert t["completion_tokens"] == 6
    # e2e covers queue + prefill + decode (tokenize and detokenize overlap them or happen outside)
    assert t["e2e_ms"] + 1e-6 >= t["queue_ms"] + t["prefill_ms"] + t["decode_ms"] - 1.0


def test_health_version_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    v = httpx.get(server.url + "/version").json()
    assert v["config"]["dtype"] == "float32" and v["max_model_len"] == 512
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "leverlab_time_to_first_token_seconds_bucket",
        "leverlab_inter_token_latency_seconds_bucket",
        "leverlab_e2e_request_latency_seconds_count",
        "leverlab_request_prefill_time_seconds_sum",
        "leverlab_request_tokenize_time_seconds_sum",
        "leverlab_num_requests_running",
        "leverlab_num_requests_waiting",
        "leverlab_kv_cache_usage_perc",
        "leverlab_kv_blocks_free",
        "leverlab_kv_blocks_total",
    ):
        assert name in text, name
