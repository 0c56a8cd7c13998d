"""Issue 18 against real servers on loopback: request templates, content types and origins, a responsive
event loop under huge bodies and big responses, bounded memory for a client that stops reading, and an engine
failure that fails open streams and ends the process with a non-zero status."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "tiny-qwen3"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_request_chat_template_is_refused_without_the_flag(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    evil = "{% for i in range(10**9) %}x{% endfor %}"
    for extra in ({"chat_template_kwargs": {"chat_template": evil}}, {"chat_template": evil}):
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body=extra)
        assert time.monotonic() - t0 < 5  # refused, not rendered
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # the server's own: fine
    assert r.choices[0].finish_reason in ("length", "stop")


def test_non_json_bodies_get_415_and_foreign_origins_403(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": ctype} if ctype else {}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = httpx.post(server.url + path, content=body, headers=headers)
            assert r.status_code == 415, (ctype, path, r.text)
            assert "application/json" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    # A web page's request carries its Origin: refused unless --allowed-origins names it; no CORS headers.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "--allowed-origins" in r.json()["error"]["message"]
    assert "access-control-allow-origin" not in r.headers
    assert httpx.get(server.url + "/health", headers={"origin": "http://evil.example"}).status_code == 200


def test_health_stays_fast_during_huge_bodies_and_big_responses(server):
    big_ids = json.dumps({"prompt": list(range(100, 300)) * 25_000, "max_tokens": 1}).encode()  # 25 MB
    big_text = json.dumps({"prompt": "hello world " * 2_500_000, "max_tokens": 1}).encode()  # 30 MB
    assert len(big_text) >= 30_000_000
    prompts = [[(7 * i + j) % 300 + 10 for j in range(440)] for i in range(16)]
    logprobs_body = {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20, "temperature": 0}
    results: dict[str, httpx.Response] = {}

    def post(name: str, **kw) -> None:
        results[name] = httpx.post(server.url + "/v1/completions", timeout=120, **kw)

    threads = [
        threading.Thread(target=post, args=("ids",), kwargs={"content": big_ids,
                                                              "headers": {"content-type": "application/json"}}),
        threading.Thread(target=post, args=("text",), kwargs={"content": big_text,
                                                               "headers": {"content-type": "application/json"}}),
        threading.Thread(target=post, args=("logprobs",), kwargs={"json": logprobs_body}),
    ]
    latencies = []
    with httpx.Client(base_url=server.url, timeout=10) as c:
        c.get("/health")
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    for t in threads:
        t.join()
    # The huge bodies can never fit the 512-token context: a 400 that says so, not a 5xx.
    for name in ("ids", "text"):
        r = results[name]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    r = results["logprobs"]
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert len(choices) == 16 and all(len(c["prompt_logprobs"]) == 440 for c in choices)
    assert len(latencies) >= 5, latencies
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1e3:.0f} ms: {sorted(latencies)[-5:]}"


def test_a_client_that_stops_reading_is_aborted_with_bounded_memory(start_server):
    srv = start_server("--stream-stall-timeout", "2")
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 500, "n": 64, "logprobs": 5, "ignore_eos": True,
                       "stream": True, "temperature": 1.0}).encode()
    # warm up the allocator with one short request of the same shape, then measure from there
    httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "n": 64, "logprobs": 5})
    srv.wait_idle()
    base = rss_mb(srv.proc.pid)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that takes (almost) nothing
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    peak, aborted = base, False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        peak = max(peak, rss_mb(srv.proc.pid))
        text = httpx.get(srv.url + "/metrics").text
        if 'leverlab_requests_rejected_total{reason="stream_stalled"} 1.0' in text:
            aborted = True
            break
        time.sleep(0.1)
    sock.close()
    assert aborted, "the stalled stream was never aborted"
    m = srv.wait_idle()
    assert m["leverlab_kv_blocks_used"] == 0 and m["leverlab_num_requests_running"] == 0
    assert m["leverlab_engine_requests_aborted_total"] >= 1
    assert peak - base < 64, f"RSS grew {peak - base:.0f} MB while the client read nothing"
    # and the server still serves
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_engine_failure_fails_open_streams_and_exits_nonzero(start_server):
    srv = start_server(env={"LEVERLAB_TEST_FAIL_AT_STEP": "20"})
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True})
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="injected engine failure"):
        for _ in stream:
            pass
    assert srv.proc.wait(timeout=10) == 1
    assert time.monotonic() - t0 < 10
    assert "the engine failed" in srv.log()
