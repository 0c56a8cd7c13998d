"""`leverlab serve --tensor-parallel-size 2`: served through the official client, and a killed worker becomes an
error for the request in flight and the server's exit with status 1 (for a supervisor to restart), within
seconds; and a two-launch "multi-host" TP=2 on loopback gives TP=1's tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import ROOT, free_port

MODEL = "tiny-qwen3"


def _spawn_children(server_pid: int) -> dict[int, str]:
    """The server's multiprocessing spawn children: {pid: comm}."""
    out = {}
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmd:
                out[int(child)] = Path(f"/proc/{child}/comm").read_text().strip()
    return out


def worker_pids(server_pid: int) -> list[int]:
    """The server's tensor-parallel worker processes: its spawn children but the body parser's process (which
    names itself leverlab-parser once started; wait for that so as not to mistake it for a rank)."""
    deadline = time.monotonic() + 30
    while "leverlab-parser" not in _spawn_children(server_pid).values() and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid, comm in _spawn_children(server_pid).items() if comm != "leverlab-parser"]


@pytest.fixture(scope="module")
def tp_server(start_server):
    return start_server("--tensor-parallel-size", "2")


def test_serves_through_openai_client(tp_server):
    client = openai.OpenAI(base_url=tp_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    m = tp_server.wait_idle()
    assert m["leverlab_kv_blocks_used"] == 0
    assert m["leverlab_engine_tp_steps_total"] >= 6
    assert m["leverlab_engine_tp_allreduce_seconds_total"] > 0


def test_killed_worker_fails_request_and_health(start_server, long_checkpoint):
    server = start_server("--tensor-parallel-size", "2", ckpt=long_checkpoint)
    (pid,) = worker_pids(server.proc.pid)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=4000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # in flight
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="died"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 10
    assert server.proc.wait(timeout=10) == 1  # a dead engine cannot recover: the process leaves
    assert time.monotonic() - t0 < 15
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=5)
    server.stop()


def test_two_launch_multi_host_tp2_equals_tp1(start_server, server, checkpoint, tmp_path):
    """Two "hosts" on loopback, launched as a multi-host job is: node 1 from torchrun's environment (WORLD_SIZE,
    RANK, MASTER_ADDR, MASTER_PORT), node 0 from the flags; they meet at torch.distributed's rendezvous."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1"}
    log = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen([sys.executable, "-m", "leverlab.cli", "serve", str(checkpoint), "--dtype", "float32",
                              "--execution-mode", "eager", "--tensor-parallel-size", "2"],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        node0 = start_server("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
                             "--master-addr", "127.0.0.1", "--master-port", str(port))
        assert _spawn_children(node0.proc.pid) and not worker_pids(node0.proc.pid)  # rank 1 is node 1's
        for prompt in ("def add(a, b):", "The quick brown fox", "Hello, world!"):
            want = _greedy(server, prompt)
            assert _greedy(node0, prompt) == want
        m = node0.wait_idle()
        assert m["leverlab_kv_blocks_used"] == 0 and m["leverlab_engine_tp_steps_total"] > 0
        assert node0.stop() == 0
        assert node1.wait(timeout=30) == 0  # rank 0 told its ranks to leave
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log.close()


def _greedy(server, prompt: str) -> list[int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return r.choices[0].logprobs.tokens
