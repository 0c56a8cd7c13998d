"""vLLM's serving surface and the request-hardening rules, in-process over the fake engine (fast):
/tokenize and /detokenize, request templates behind --trust-request-chat-template, --chat-template,
415 for non-JSON bodies, --allowed-origins (CORS), admission in sequences, --max-logprobs,
--generation-config, the vllm: metric names, and the EngineClient seam."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from leverlab.engine.client import EngineClient
from leverlab.server.app import build_app
from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.checkpoints import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def app_client(tokenizer, **args) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(tokenizer)
    ns = SimpleNamespace(served_model_name=None, api_key=None, **args)
    return TestClient(build_app(engine, ns)), engine


def test_fake_engine_implements_the_engine_client_protocol(tokenizer):
    assert isinstance(FakeEngine(tokenizer), EngineClient)


def test_tokenize_and_detokenize(tokenizer):
    c, _ = app_client(tokenizer)
    r = c.post("/tokenize", json={"prompt": "def add(a, b):", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("def add(a, b):") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128 and len(body["token_strs"]) == body["count"]
    assert c.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == "def add(a, b):"
    r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert tokenizer.decode(r.json()["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert c.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert c.post("/tokenize", json={}).status_code == 400


def test_request_templates_need_the_trust_flag(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    c, _ = app_client(tokenizer)
    for extra in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **extra})
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400
    trusted, _ = app_client(tokenizer, trust_request_chat_template=True)
    r = trusted.post("/tokenize", json={"messages": msgs, "chat_template": own})
    assert r.status_code == 200 and tokenizer.decode(r.json()["tokens"]) == "[hi]"
    r = trusted.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "chat_template": own})
    assert r.status_code == 200, r.text


def test_server_chat_template_flag(tokenizer, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    c, _ = app_client(tokenizer, chat_template=str(f))
    r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}]})
    assert tokenizer.decode(r.json()["tokens"]) == "<<yo>>"


def test_content_type_and_origins(tokenizer):
    c, _ = app_client(tokenizer)
    r = c.post("/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
               headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"origin": "http://a.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert c.post("/tokenize", json={"prompt": "x"}, headers={"origin": "http://a.example"}).status_code == 403
    c, _ = app_client(tokenizer, allowed_origins=["http://a.example"])
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"origin": "http://a.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"
    pre = c.options("/v1/completions", headers={"origin": "http://a.example", "access-control-request-method": "POST",
                                                "access-control-request-headers": "content-type"})
    assert pre.status_code == 200
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"origin": "http://b.example"})
    assert r.status_code == 403


def test_admission_in_sequences(tokenizer):
    c, _ = app_client(tokenizer)
    st = c.app.state.server
    st.admission.max_seqs = 16  # as an engine with capacity_seqs 16 would set it
    r = c.post("/v1/completions", json={"prompt": [[5, 6]] * 4, "n": 8, "max_tokens": 2})
    assert r.status_code == 400 and "can never be admitted" in r.json()["error"]["message"], r.text
    r = c.post("/v1/completions", json={"prompt": [[5, 6]] * 4, "n": 4, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert st.admission.seqs == 0 and st.admission.bytes == 0  # all released
    st.admission.seqs = 14  # as if others held 14 of the 16
    r = c.post("/v1/completions", json={"prompt": "x", "n": 4, "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    st.admission.seqs = 0


def test_max_logprobs_and_generation_config(tokenizer, tmp_path):
    c, _ = app_client(tokenizer, max_logprobs=2)
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 3})
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    # vLLM's fields of generation_config.json (ModelConfig.get_diff_sampling_param), applied where the request
    # leaves them out; do_sample is not read, as in vLLM
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "min_p": 0.05, "repetition_penalty": 1.1,
         "presence_penalty": 0.2, "frequency_penalty": 0.3, "do_sample": False, "max_new_tokens": 5}))
    c, engine = app_client(tokenizer, generation_config=str(tmp_path))
    seen = []
    orig = engine.generate

    def spy(prompt, params, rid):
        seen.append(params)
        return orig(prompt, params, rid)

    engine.generate = spy
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 0.9})
    assert (seen[0].temperature, seen[0].top_k, seen[0].top_p) == (0.25, 7, 0.5)
    assert seen[1].temperature == 0.9 and seen[1].top_k == 7
    assert (seen[0].min_p, seen[0].repetition_penalty, seen[0].presence_penalty, seen[0].frequency_penalty) == (
        0.05, 1.1, 0.2, 0.3)
    c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                         "repetition_penalty": 1.0, "min_p": 0.0})
    assert (seen[2].repetition_penalty, seen[2].min_p, seen[2].presence_penalty) == (1.0, 0.0, 0.2)
    c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 9})
    assert (seen[3].max_tokens, seen[4].max_tokens) == (5, 9)  # max_new_tokens caps only an open max_tokens


def test_vllm_metric_names(tokenizer):
    c, _ = app_client(tokenizer)
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    text = c.get("/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total"):
        assert f'{name}{{' in text, name
    assert 'vllm:e2e_request_latency_seconds_count{model_name="fake-model"} 1.0' in text
