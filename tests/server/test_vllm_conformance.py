"""Where scripts/conformance_vllm.py found us differing from vLLM's own server and vLLM was right, fixed; each fix
checked here in-process over the fake engine (fast). The differential run itself (both servers, the bundled
model) is the one slow test at the end, skipped where vLLM is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from starlette.testclient import TestClient

from leverlab.server.app import build_app
from tests.server.conftest import ROOT
from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.checkpoints import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


class PromptLogprobsEngine(FakeEngine):
    """The fake engine, with prompt logprobs when asked (the prompt's own token at each position)."""

    async def generate(self, prompt, params, request_id):
        async for out in super().generate(prompt, params, request_id):
            if params.prompt_logprobs is not None:
                ids = out.prompt_token_ids
                # the prompt's own token is the second most likely here: rank 2 among the top 1 and beyond
                out.prompt_logprobs = [None] + [{t: -2.0, (t + 1) % 200: -1.0} for t in ids[1:]]
                out.prompt_ranks = [None] + [2] * (len(ids) - 1)
            yield out


@pytest.fixture
def client(tokenizer):
    with TestClient(build_app(PromptLogprobsEngine(tokenizer), SimpleNamespace(served_model_name=None,
                                                                                 api_key=None))) as c:
        yield c


def events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


CHAT = [{"role": "user", "content": "hi"}]


def test_vllm_keys_are_always_there(client):
    """vLLM's responses always hold its extension keys (null unless asked) and OpenAI's system_fingerprint."""
    c = client.post("/v1/completions", json={"prompt": "def add", "max_tokens": 3}).json()
    assert c["system_fingerprint"].startswith("leverlab-")
    assert {k: c["choices"][0][k] for k in ("token_ids", "prompt_token_ids", "prompt_logprobs")} == dict.fromkeys(
        ("token_ids", "prompt_token_ids", "prompt_logprobs"))
    h = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3}).json()
    assert h["system_fingerprint"].startswith("leverlab-")
    assert h["prompt_logprobs"] is None and h["prompt_token_ids"] is None and h["choices"][0]["token_ids"] is None
    chunks = events(client.post("/v1/completions", json={"prompt": "def add", "max_tokens": 3, "stream": True}))
    assert "system_fingerprint" in chunks[-1] and all("system_fingerprint" not in x for x in chunks[:-1])
    assert all(ch["token_ids"] is None and ch["prompt_token_ids"] is None for x in chunks for ch in x["choices"])


def test_return_token_ids(client, tokenizer):
    """vLLM's return_token_ids: the generated ids per choice, the prompt's ids once (was silently ignored)."""
    prompt_ids = tokenizer.encode("def add")
    c = client.post("/v1/completions", json={"prompt": "def add", "max_tokens": 4, "n": 2, "temperature": 1,
                                             "return_token_ids": True}).json()
    for ch in c["choices"]:
        assert len(ch["token_ids"]) == 4 and ch["prompt_token_ids"] == prompt_ids
        assert tokenizer.decode(ch["token_ids"]) == ch["text"]
    chunks = events(client.post("/v1/completions", json={"prompt": "def add", "max_tokens": 4, "stream": True,
                                                          "return_token_ids": True}))
    choices = [ch for x in chunks for ch in x["choices"]]
    assert sum((ch["token_ids"] for ch in choices), []) == c["choices"][0]["token_ids"]
    assert [ch["prompt_token_ids"] for ch in choices if ch["prompt_token_ids"]] == [prompt_ids]

    h = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "return_token_ids": True}).json()
    assert len(h["choices"][0]["token_ids"]) == 4 and h["prompt_token_ids"][0:1] and h["prompt_logprobs"] is None
    chunks = events(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "stream": True,
                                                               "return_token_ids": True}))
    assert chunks[0]["prompt_token_ids"] == h["prompt_token_ids"]
    assert all("prompt_token_ids" not in x for x in chunks[1:])
    assert sum((ch["token_ids"] for x in chunks for ch in x["choices"]), []) == h["choices"][0]["token_ids"]


def test_continuous_usage_stats(client):
    """With include_usage and continuous_usage_stats every chunk carries the usage so far (was only the end)."""
    for route, body in (("completions", {"prompt": "def add"}), ("chat/completions", {"messages": CHAT})):
        chunks = events(client.post(f"/v1/{route}", json={**body, "max_tokens": 5, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
        counted = [x["usage"]["completion_tokens"] for x in chunks if x["choices"]]
        assert counted and counted == sorted(counted) and counted[-1] == 5, chunks
        assert all(x["usage"]["total_tokens"] == x["usage"]["prompt_tokens"] + x["usage"]["completion_tokens"]
                   for x in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        # continuous_usage_stats alone (without include_usage) asks for nothing, as in vLLM
        plain = events(client.post(f"/v1/{route}", json={**body, "max_tokens": 3, "stream": True,
                                                          "stream_options": {"continuous_usage_stats": True}}))
        assert all("usage" not in x for x in plain)


def test_chat_prompt_logprobs(client):
    """prompt_logprobs on chat (vLLM takes it there too; it was silently ignored): beside the choices."""
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1})
    body = r.json()
    plp, ids = body["prompt_logprobs"], body["prompt_token_ids"]
    assert plp[0] is None and len(plp) == len(ids) > 1
    assert all(str(t) in row and row[str(t)]["logprob"] == -2.0 for t, row in zip(ids[1:], plp[1:]))
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1,
                                                  "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_prompt_token_rank_is_its_rank_in_the_vocabulary(client):
    """vLLM gives the prompt's own token its rank among all tokens; ours was null outside the top k."""
    from leverlab.worker.sampler import token_ranks

    logits = torch.tensor([[0.1, 3.0, 2.0, 2.0, -1.0], [5.0, 1.0, 1.0, 1.0, 1.0]])
    assert token_ranks(logits, torch.tensor([2, 0])) == [3, 1]  # ties count as at least as likely (vLLM's)
    assert token_ranks(logits, torch.tensor([4, 4])) == [5, 5]
    plp = client.post("/v1/completions", json={"prompt": "def add(a, b)", "max_tokens": 1, "prompt_logprobs": 1,
                                               "return_token_ids": True}).json()["choices"][0]
    for t, row in zip(plp["prompt_token_ids"][1:], plp["prompt_logprobs"][1:]):
        assert row[str(t)]["rank"] == 2 and row[str((t + 1) % 200)]["rank"] == 1


def test_completion_top_logprobs_hold_the_chosen_token(client):
    """As vLLM: each position's dict holds the chosen token (first) and the top k; logprobs=0 still shows it."""
    def logprobs(k: int) -> dict:
        body = {"prompt": "x", "max_tokens": 3, "logprobs": k, "return_tokens_as_token_ids": True}
        return client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]

    lp = logprobs(0)
    assert [list(d.items()) for d in lp["top_logprobs"]] == [[(t, -0.5)] for t in lp["tokens"]]
    lp = logprobs(2)
    assert all(list(d.values()) == [-0.5, -1.5] and next(iter(d)) == t for d, t in zip(lp["top_logprobs"], lp["tokens"]))


def test_max_tokens_is_cut_to_the_context(client):
    """vLLM's rule: max_tokens beyond the room the prompt leaves is cut to that room (finish_reason "length");
    over the whole context, or a prompt that fills it alone, is still a 400. The fake's context: 128."""
    r = client.post("/v1/completions", json={"prompt": [5] * 120, "max_tokens": 20})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 8
    # each prompt of a batch gets its own room
    r = client.post("/v1/completions", json={"prompt": [[5] * 120, [5, 6]], "max_tokens": 20})
    assert [len(c["text"]) > 0 for c in r.json()["choices"]] == [True, True]
    assert r.json()["usage"]["completion_tokens"] == 8 + 20
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 129})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = client.post("/v1/completions", json={"prompt": [5] * 120, "max_tokens": 20, "min_tokens": 10})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [5] * 128, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_differential_conformance_against_vllm(tmp_path):
    """scripts/conformance_vllm.py: both servers on the bundled model, float32, greedy; zero unexplained
    differences (shapes, statuses, finish reasons, usage, and the generated tokens themselves)."""
    from leverlab.bench import peer_vllm

    why = peer_vllm.missing()
    if why:
        pytest.skip(f"vLLM is not installed, so there is nothing to compare against: {why}")
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "scripts/conformance_vllm.py", "--json", str(out), "--log-dir",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) > 90 and not [x for x in results if x["verdict"] == "differs"]
