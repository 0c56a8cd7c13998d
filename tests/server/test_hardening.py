"""Issue 18 against real servers on loopback: request templates, content types and origins, a responsive
event loop under huge bodies and big responses, bounded memory for a client that stops reading, and an engine
failure that fails open streams and ends the process with a non-zero status."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.checkpoints import make_checkpoint

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


# Polls /health every 20 ms: first for IDLE_S with the server idle (the machine's own jitter: this machine
# is shared, and a busy neighbour alone delays a probe by tens of ms), then until stdin closes.
IDLE_S = 1.5
POLL_HEALTH = """
import json, sys, threading, time, httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
idle, busy = [], []
with httpx.Client(base_url=sys.argv[1], timeout=10) as c:
    c.get("/health")
    t_start = time.monotonic()
    print("ready", flush=True)
    while not stop.is_set():
        t0 = time.perf_counter()
        assert c.get("/health").status_code == 200
        (idle if time.monotonic() - t_start < IDLE_S else busy).append(time.perf_counter() - t0)
        time.sleep(0.02)
print(json.dumps([idle, busy]))
""".replace("IDLE_S", str(IDLE_S))


def test_health_stays_fast_during_huge_bodies_and_big_responses(server):
    big_ids = json.dumps({"prompt": list(range(100, 300)) * 25_000, "max_tokens": 1}).encode()  # 25 MB
    big_text = json.dumps({"prompt": "hello world " * 2_500_000, "max_tokens": 1}).encode()  # 30 MB
    assert len(big_text) >= 30_000_000
    prompts = [[(7 * i + j) % 300 + 10 for j in range(440)] for i in range(16)]
    logprobs_body = json.dumps({"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20,
                                "temperature": 0}).encode()
    # The regressions this guards against block the loop for 0.5-20 s on every try; a try that misses the
    # bound by tens of ms is a neighbour on this shared 2-core machine (load 4-5 while this was written)
    # descheduling a thread that holds the GIL. So: up to three tries, one must meet the bound.
    tries = []
    for _ in range(3):
        idle, busy = _health_under_load(server.url, big_ids, big_text, logprobs_body)
        idle_ms, busy_ms, median_ms = max(idle) * 1e3, max(busy) * 1e3, sorted(busy)[len(busy) // 2] * 1e3
        tries.append((round(idle_ms), round(busy_ms), round(median_ms), len(busy)))
        print(f"/health: idle max {idle_ms:.0f} ms; under the load max {busy_ms:.0f} ms, median {median_ms:.0f} ms "
              f"({len(busy)} probes)")
        # within 100 ms, beyond what the machine's own jitter gives the idle server (before the fix: 1.9 s)
        if max(busy) < 0.1 + max(idle):
            break
    else:
        pytest.fail(f"/health was slow under load in every try (idle max, busy max, median, probes): {tries}")


def _health_under_load(url: str, big_ids: bytes, big_text: bytes, logprobs_body: bytes):
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: bytes) -> None:
        results[name] = httpx.post(url + "/v1/completions", content=body, timeout=120,
                                   headers={"content-type": "application/json"})

    threads = [threading.Thread(target=post, args=a) for a in
               (("ids", big_ids), ("text", big_text), ("logprobs", logprobs_body))]
    # /health is timed from another process: this one's threads (sending 55 MB, reading a 10 MB answer) would
    # otherwise add their own GIL waits to the figure.
    poller = subprocess.Popen([sys.executable, "-c", POLL_HEALTH, url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert poller.stdout.readline().strip() == "ready"
    time.sleep(IDLE_S + 0.1)  # the idle baseline first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out, _ = poller.communicate("", timeout=30)
    idle, busy = json.loads(out)
    # The huge bodies can never fit the 512-token context: a 400 that says so, not a 5xx.
    for name in ("ids", "text"):
        r = results[name]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    r = results["logprobs"]
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert len(choices) == 16 and all(len(c["prompt_logprobs"]) == 440 for c in choices)
    assert len(busy) >= 5, busy
    return idle, busy


@pytest.mark.slow
def test_a_client_that_stops_reading_is_aborted_with_bounded_memory(start_server, tmp_path):
    """Checked to fail with a queue of every step's output in place of the one-slot mailbox: +189 MB against
    +27 MB with it (the stall timeout leaves the engine ~6 s to run ahead of the reader).
    The request must outlast the stall timeout by a wide margin, or the engine finishes it before the stall is
    seen and there is nothing to abort: 2000 steps of 64 sequences take ~25 s here (490 steps took ~5.6 s and
    did finish first), so the checkpoint gets a 2048-token context."""
    ckpt = make_checkpoint(tmp_path / "long-context", arch="qwen3", max_position_embeddings=2048)
    srv = start_server("--stream-stall-timeout", "6", ckpt=ckpt)
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 2000, "n": 64, "logprobs": 5, "ignore_eos": True,
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
    assert m["leverlab_engine_requests_aborted_total"] >= 1, "the engine finished the request before the stall"
    print(f"slow reader: RSS {base:.0f} MB -> peak {peak:.0f} MB")
    assert peak - base < 64, f"RSS grew {peak - base:.0f} MB while the client read nothing"
    # and the server still serves
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_engine_failure_fails_open_streams_and_exits_nonzero(start_server):
    # At step 200, not 20: 20 steps of the tiny model can outrun the server's event loop before it takes the
    # stream's first output, and then the request fails before its stream begins (a clean 503, but not the case
    # tested here; seen once in a fresh-clone CI run on a Zen 5).
    srv = start_server(env={"LEVERLAB_TEST_FAIL_AT_STEP": "200"})
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
