"""The app in-process over a fake engine: response shapes, error mapping, faults on demand. Fast (no model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from leverlab.server.app import build_app
from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.checkpoints import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, SimpleNamespace(served_model_name=None, api_key=None))) as c:
        yield c


def sse_events(text: str) -> list:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_shape_usage_timings(client):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "def add", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert set(body["timings"]) >= {"tokenize_ms", "queue_ms", "prefill_ms", "decode_ms", "detokenize_ms"}


def test_logprobs_never_emit_infinity(client):
    # token ids as tokens: the fake's neighbouring ids print as one text, which would share a key
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 3,
                                             "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(v == -0.5 for v in lp["token_logprobs"])
    assert min(v for d in lp["top_logprobs"] for v in d.values()) == -9999.0


def test_stream_diffs_add_up_and_usage_chunk_last(client):
    body = {
        "prompt": "hello",
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    full = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "n": 2}).json()
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r.read().decode())
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks[:-1]:
        assert c["usage"] is None
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            if ch["finish_reason"]:
                finishes[ch["index"]].append(ch["finish_reason"])
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert "timings" in chunks[-1]


def test_chat_stream_role_first(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = sse_events(r.read().decode())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "timings" in chunks[-1]


def test_batch_of_prompts(client):
    r = client.post("/v1/completions", json={"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    assert isinstance(r.json()["timings"], list)


def test_engine_errors_map_to_status(client, engine):
    engine.max_running, engine.max_waiting = 0, 0
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded_error"
    engine.max_running, engine.max_waiting = 4, 4
    engine.dead = True
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_unknown_model_and_route(client):
    r = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_api_key(engine):
    app = build_app(engine, SimpleNamespace(served_model_name=["a", "b"], api_key="sekret"))
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert [m["id"] for m in r.json()["data"]] == ["a", "b"]
        assert c.get("/health").status_code == 200  # open for load balancers


def test_metrics_exposes_engine_gauges(client):
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    text = client.get("/metrics").text
    for name in (
        "leverlab_kv_blocks_free 64.0",
        "leverlab_kv_blocks_total 64.0",
        "leverlab_engine_prefix_cache_hits_total",
        "leverlab_time_to_first_token_seconds_count 1.0",
        "leverlab_request_queue_time_seconds_bucket",
    ):
        assert name in text, name


def test_chat_without_template_is_a_clear_400(tokenizer):
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = None
    with TestClient(build_app(FakeEngine(tok), SimpleNamespace())) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"]
    assert "/v1/completions" in r.json()["error"]["message"]


def test_stream_cut_by_the_drain_ends_with_abort_and_done(engine):
    app = build_app(engine, SimpleNamespace())
    state = app.state.server

    def drain_at(step: int) -> None:  # what the SIGTERM handler does, compressed: drain, then stop
        if step == 2:
            state.draining = True
        if step == 4:
            state.stopped.set()

    engine.on_step = drain_at
    body = {"prompt": "x", "max_tokens": 50, "n": 2, "stream": True}
    with TestClient(app) as c, c.stream("POST", "/v1/completions", json=body) as r:
        chunks = sse_events(r.read().decode())
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["abort", "abort"]
    assert engine.aborted  # the engine request was closed, so its blocks are freed


def test_engines_implement_the_whole_client_protocol(engine):
    """The server reads only EngineClient's members, never probes: so every engine it serves has them all."""
    from leverlab.engine.async_engine import AsyncLLM
    from leverlab.engine.client import EngineClient
    from leverlab.engine.replicas import ReplicaSet

    assert isinstance(engine, EngineClient)
    methods = {"healthy", "degraded", "health", "capacity_seqs", "generate", "abort", "reset_prefix_cache", "stats",
               "shutdown"}
    assert methods <= set(dir(EngineClient))
    for cls in (AsyncLLM, ReplicaSet):  # data members are set in __init__: the callables and properties here
        missing = sorted(m for m in methods if not hasattr(cls, m) and m != "capacity_seqs")
        assert not missing, f"{cls.__name__} lacks {missing}"
