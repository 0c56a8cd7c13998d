"""Bad requests against the real server: each gets an OpenAI-shaped 4xx saying what to fix; the server lives on.

Includes a property test: generated request bodies (valid, half-valid and nonsense) never get a 5xx.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err["message"])
    return err


RAW_CASES = [
    ("malformed JSON", b'{"prompt": "hi", ', "malformed JSON"),
    ("not an object", b'["prompt", "hi"]', "JSON object"),
    ("empty body", b"", "empty"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe hi"}', "UTF-8"),
    ("lone surrogate", b'{"prompt": "\\ud800"}', "surrogate"),
    ("huge integer", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "malformed JSON"),
    ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("deep nesting", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", ""),
]


@pytest.mark.parametrize("name,body,words", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_bodies(http, name, body, words):
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, words)


CASES = [
    # (route, body, status, words in the message)
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("completions", {"prompt": "hi", "temperature": True}, 400, ["temperature"]),
    ("completions", {"prompt": 5}, 400, ["prompt"]),
    ("completions", {"prompt": [1, "a"]}, 400, ["prompt"]),
    ("completions", {}, 400, ["prompt"]),
    ("completions", {"prompt": ""}, 400, ["empty"]),
    ("completions", {"prompt": []}, 400, ["prompt"]),
    ("completions", {"prompt": [99999]}, 400, ["99999", "vocabulary"]),
    ("completions", {"prompt": [-1]}, 400, ["-1"]),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, ["gpt-4"]),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, ["max_tokens"]),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
    ("completions", {"prompt": "hi", "max_tokens": 10**12}, 400, ["512", str(10**12)]),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, ["temperature"]),
    ("completions", {"prompt": "hi", "temperature": 1e308}, 400, ["temperature"]),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, ["top_p"]),
    ("completions", {"prompt": "hi", "top_k": -5}, 400, ["top_k"]),
    ("completions", {"prompt": "hi", "n": 0}, 400, ["n must"]),
    ("completions", {"prompt": "hi", "n": 10**6}, 400, ["n must"]),
    ("completions", {"prompt": "hi", "logprobs": 1000}, 400, ["logprobs"]),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, ["stop"]),
    ("completions", {"prompt": "hi", "stop": ["x"] * 1000}, 400, ["stop"]),
    ("completions", {"prompt": "hi", "seed": 2**80}, 400, ["seed"]),
    ("completions", {"prompt": "hi", "seed": 2**63}, 400, ["seed"]),
    ("completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, ["min_tokens"]),
    ("completions", {"prompt": "hi", "stop_token_ids": [100000], "min_tokens": 2}, 400, ["100000"]),
    ("completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, ["presence_penalty", "[-2, 2]"]),
    ("completions", {"prompt": "hi", "guided_json": {"type": "nonsense"}}, 400, ["json", "does not compile"]),
    ("completions", {"prompt": "hi", "guided_json": {"type": "object"}, "guided_regex": "a"}, 400, ["guided_regex"]),
    ("completions", {"prompt": "hi", "guided_decoding_backend": "xgrammar"}, 400, ["guided_decoding_backend"]),
    ("completions", {"prompt": "hi", "max_token": 3}, 400, ["max_token", "unknown field"]),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, ["stream"]),
    ("chat/completions", {"messages": []}, 400, ["messages"]),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, ["role"]),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, ["content"]),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 100000}, 400, ["512", "100000"]),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, ["logprobs"]),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, ["tools"]),
    ("chat/completions", {"messages": CHAT, "model": "nope"}, 404, ["nope"]),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 600}]},
        400,
        ["512", "prompt alone"],
    ),
    ("completions", {"prompt": "hi " * 600, "max_tokens": None}, 400, ["512", "prompt alone"]),
]


@pytest.mark.parametrize("route,body,status,words", CASES, ids=[f"{c[0]}:{c[1]}"[:60] for c in CASES])
def test_bad_parameters(http, route, body, status, words):
    assert_openai_error(http.post(f"/v1/{route}", json=body), status, *words)


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/engines"), 404, "no route")
    assert_openai_error(http.get("/v1/completions"), 405, "GET")


def test_null_max_tokens_fills_the_context(http):
    # found by the property test: an explicit null means "as many as fit" (vLLM's reading), not a crash
    r = http.post("/v1/completions", json={"prompt": "0", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 512


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_vanishing_temperature_is_greedy(http, temperature):
    # found by the property test: logits / 1e-300 overflow; below 1e-5 a temperature means greedy (vLLM's rule)
    body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={**body, "temperature": temperature})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_extreme_seeds_with_n(http, seed):
    # the engine seeds choice i with seed + i: a seed near 2**64 would overflow torch's generator
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3, "seed": seed})
    assert r.status_code == 200, r.text


def test_server_still_serves_after_bad_input(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---- property test: generated bodies --------------------------------------------------------------------
# Each field is usually in range and sometimes junk, so about half the bodies are valid and reach the engine
# (exercising sampling, stop strings, logprobs, n, streaming) and the rest probe validation one field at a time.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


def _mostly(valid, junk=_json):
    """`valid` nine times in ten, else `junk` (shrinking leans to `valid`)."""
    return st.sampled_from(range(10)).flatmap(lambda k: junk if k == 9 else valid)


_fields = {
    "model": _mostly(st.sampled_from(["tiny-qwen3"] * 4 + ["other"])),
    "max_tokens": _mostly(st.integers(1, 6)),
    "temperature": _mostly(st.floats(0, 2)),
    "top_p": _mostly(st.floats(0.05, 1)),
    "top_k": _mostly(st.integers(-1, 50)),
    "seed": _mostly(st.integers(-(2**63), 2**63 - 1)),
    "n": _mostly(st.integers(1, 3)),
    "stop": _mostly(st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.text(min_size=1, max_size=3)),
    "min_tokens": _mostly(st.integers(0, 2)),
    "ignore_eos": _mostly(st.booleans()),
    "stream": st.booleans(),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 380), max_size=3)),
    "skip_special_tokens": _mostly(st.booleans()),
}
_completion_fields = {**_fields, "logprobs": _mostly(st.integers(0, 5)), "echo": _mostly(st.booleans())}
_chat_fields = {
    **_fields,
    "logprobs": _mostly(st.booleans()),
    "top_logprobs": _mostly(st.integers(0, 5)),
    "max_completion_tokens": _mostly(st.integers(1, 6)),
}
_prompt = _mostly(
    st.text(min_size=1, max_size=40)
    | st.lists(st.integers(0, 380), min_size=1, max_size=8)
    | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3)
)
_message = st.fixed_dictionaries(
    {
        "role": _mostly(st.sampled_from(["user", "system", "assistant", "developer", "tool"])),
        "content": _mostly(
            st.text(max_size=30)
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2
            )
        ),
    }
)
_completion_body = st.fixed_dictionaries({"prompt": _prompt}, optional=_completion_fields)
# chat without a max_tokens fills the context (512 tokens): covered once elsewhere, kept out of here for speed
_chat_body = st.fixed_dictionaries(
    {
        "messages": _mostly(st.lists(_message, min_size=1, max_size=3)),
        "max_tokens": _mostly(st.integers(1, 6)),
    },
    optional={k: v for k, v in _chat_fields.items() if k != "max_tokens"},
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(["completions", "chat/completions"]),
    completion=_completion_body,
    chat=_chat_body,
    junk=_json,
)
def test_generated_bodies_never_5xx(http, route, completion, chat, junk):
    body = completion if route == "completions" else chat
    if isinstance(junk, dict):
        body = {**junk, **body}  # unknown fields are refused with a 4xx, never fatal
    if body.get("stream") is True:
        with http.stream("POST", f"/v1/{route}", json=body) as r:
            content = r.read()
        assert r.status_code < 500, content
        if r.status_code == 200:
            assert content.rstrip().endswith(b"data: [DONE]")
            assert b'"error"' not in content, content  # no failure in-band either
    else:
        r = http.post(f"/v1/{route}", json=body)
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert "message" in r.json()["error"]


def test_alive_after_generated_bodies(http, server):
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    assert server.proc.poll() is None
