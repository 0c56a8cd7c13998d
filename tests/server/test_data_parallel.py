"""`leverlab serve --data-parallel-size 2`: two engine replicas behind one endpoint, through the official client.

Greedy float32 output equals one replica's; prompts that share a long system prompt all go to the replica
that caches it (its prefix-cache hits count them); a replica killed mid-run fails only its own requests, with
an error, while the other's complete, /health says degraded and the server keeps serving.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

MODEL = "tiny-qwen3"
PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Hello, world! How are"]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(server, prompt: str, n: int = 12) -> str:
    r = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True})
    return r.choices[0].text


def per_replica(server, name: str) -> dict[str, float]:
    """{replica: value} of a labelled leverlab_replica_* sample."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}{{replica="(\d+)"}} (\S+)$', text, re.M)}


@pytest.fixture(scope="module")
def dp_server(start_server):
    return start_server("--data-parallel-size", "2")


def test_greedy_float32_equals_one_replica(dp_server, server):
    assert [greedy(dp_server, p) for p in PROMPTS] == [greedy(server, p) for p in PROMPTS]
    m = dp_server.wait_idle()
    assert m["leverlab_kv_blocks_used"] == 0
    finished = per_replica(dp_server, "leverlab_replica_engine_requests_finished_total")
    assert sorted(finished) == ["0", "1"] and all(v > 0 for v in finished.values())  # both served
    health = httpx.get(dp_server.url + "/health", timeout=5).json()
    assert health["status"] == "ok" and health["replicas_up"] == 2


def test_prefix_affinity_sends_a_shared_system_prompt_to_one_replica(dp_server):
    system = "You are a careful assistant. " + "The quick brown fox jumps over the lazy dog. " * 12
    tokens = len(dp_server_tokens(dp_server, system))
    assert tokens >= 96  # six full blocks of 16 shared
    before_done = per_replica(dp_server, "leverlab_replica_engine_requests_finished_total")
    before_hits = per_replica(dp_server, "leverlab_replica_engine_prefix_cache_hits_total")
    n = 6
    for i in range(n):  # one at a time: both replicas idle, so only affinity decides
        greedy(dp_server, system + f"Question {i}: what is {i} + {i}?", 4)
    done = per_replica(dp_server, "leverlab_replica_engine_requests_finished_total")
    hits = per_replica(dp_server, "leverlab_replica_engine_prefix_cache_hits_total")
    served = {r: done[r] - before_done.get(r, 0) for r in done}
    (home,) = [r for r, v in served.items() if v > 0]  # every one of them on one replica
    assert served[home] == n
    # the five after the first found the system prompt's blocks in that replica's cache
    assert hits[home] - before_hits.get(home, 0) >= (n - 1) * 16 * (tokens // 16 - 1)
    assert dp_server.metrics()["leverlab_engine_dp_affinity_routed_total"] >= n - 1


def dp_server_tokens(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=10).json()["tokens"]


LONG = 4000  # tokens a stream asks for: ~5 s on the tiny model, where 480 took 0.3 s and could end before the kill


def test_killed_replica_fails_only_its_requests(start_server, long_checkpoint):
    server = start_server("--data-parallel-size", "2", ckpt=long_checkpoint)
    pids = {r["index"]: r["pid"] for r in httpx.get(server.url + "/health", timeout=5).json()["replicas"]}
    c = client(server)
    # Two streams in flight: the second goes to the other replica (the first's is busier).
    streams = [c.completions.create(model=MODEL, prompt=p, max_tokens=LONG, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
               for p in PROMPTS[:2]]
    firsts = []
    for s in streams:
        firsts.append(next(iter(s)))
    deadline = time.monotonic() + 2  # replicas report their stats every 0.1 s while busy
    while (running := per_replica(server, "leverlab_replica_num_requests_running")) != {"0": 1.0, "1": 1.0}:
        assert time.monotonic() < deadline, running  # both in flight, one on each replica, when the kill comes
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    results: list[str | int] = [None, None]

    def drain(i):
        try:
            usage = [chunk.usage for chunk in streams[i] if chunk.usage is not None]
            results[i] = usage[-1].completion_tokens
        except openai.APIError as e:
            results[i] = str(e)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    failed = [r for r in results if isinstance(r, str)]
    ok = [r for r in results if isinstance(r, int)]
    assert len(failed) == 1 and len(ok) == 1, (results, running)
    assert "replica 0" in failed[0] and "died" in failed[0]
    assert ok[0] == LONG  # the other replica's stream ran to its end
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded" and body["replicas_up"] == 1
    assert not body["replicas"][0]["up"] and "signal 9" in body["replicas"][0]["error"]
    assert greedy(server, "def add(a, b):")  # the server goes on with the replica left
    assert per_replica(server, "leverlab_replica_up") == {"0": 0.0, "1": 1.0}
    assert server.wait_idle()["leverlab_kv_blocks_used"] == 0
    assert server.proc.poll() is None
    assert server.stop() == 0
