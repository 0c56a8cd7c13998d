"""End to end: a short sweep against the real `leverlab serve` on a tiny random checkpoint.

TODO(lead): the skip below exists because the server was built in parallel with the harness; once
`leverlab.server.app` is always present, drop the guard so a broken import fails instead of skipping.
The checkpoint comes from the shared `checkpoint_factory` fixture (tests/conftest.py, tests/checkpoints.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leverlab.bench import BenchConfig, run_benchmark

from .conftest import free_port, wait_http

try:
    import leverlab.server.app  # noqa: F401

    SERVER_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any failure means the server is not ready
    SERVER_IMPORT_ERROR = f"{type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(
    SERVER_IMPORT_ERROR is not None,
    reason=f"leverlab.server.app cannot be imported yet ({SERVER_IMPORT_ERROR})",
)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]


@pytest.fixture(scope="module")
def server(checkpoint_factory):
    ckpt = checkpoint_factory("qwen3")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "leverlab.cli",
        "serve",
        ckpt,
        "--port",
        str(port),
        "--execution-mode",
        "eager",
        "--dtype",
        "float32",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=120)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_short_sweep_complete_and_consistent(server, make_workload, tmp_path):
    wl = make_workload(
        {"short": (8, TEXTS[:3]), "medium": (8, [t * 4 for t in TEXTS]), "decode": (32, TEXTS[:2])}
    )
    out = tmp_path / "e2e"
    res = run_benchmark(
        BenchConfig(
            base_url=server,
            workload_file=str(wl),
            concurrency=[1, 2, 4],
            sweep_rounds=2,
            warmup=1,
            out_dir=str(out),
        )
    )
    for name in ("records.jsonl", "summary.json", "summary.csv", "report.md"):
        assert (out / name).stat().st_size > 0
    assert len(list((out / "plots").glob("*.png"))) == 4
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    planned = 1 + sum(p["requests"] for p in res.manifest["phases"])
    assert len(records) == planned == 1 + (3 + 4 + 2) + (4 + 4 + 8)  # every request accounted for
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad[:2]
    for r in records:
        assert r["output_tokens"] == r["output_len"], r["id"]  # ignore_eos + min_tokens hold lengths exact
        assert r["output_tokens_source"] == "usage" and r["prompt_tokens"] > 0
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert r["server_timings"] and r["server_timings"]["decode_ms"] >= 0
    for g in res.groups:
        assert g["errors"] == 0 and g["output_len_mismatches"] == 0
        assert (
            g["total_output_tokens"] == g["requests"] * {"short": 8, "medium": 8, "decode": 32}[g["bucket"]]
        )
        assert g["server_timings_ms"]["requests_reporting"] == g["requests"]
    m = res.manifest
    assert m["server"]["version"]["config"]["execution_mode"] == "eager"  # lever settings recorded
    assert m["server"]["metrics_available"] and res.prometheus["deltas"]


def test_chat_endpoint(server, make_workload):
    wl = make_workload({"short": (6, TEXTS[:2])})
    res = run_benchmark(
        BenchConfig(
            base_url=server,
            workload_file=str(wl),
            endpoint="chat",
            concurrency=[],
            warmup=0,
            buckets=["short", "chat"],
            output_len=5,
        )
    )
    for g in res.groups:
        assert g["errors"] == 0 and g["output_tokens"]["min"] == g["output_tokens"]["max"] == 5, g["name"]


def test_synthetic_uses_the_served_models_tokenizer(server, checkpoint_factory):
    # No --tokenizer: the server's /v1/models `root` is a local folder, so its tokenizer counts the prompts,
    # and the counts agree with the server's own usage.prompt_tokens.
    res = run_benchmark(
        BenchConfig(
            base_url=server,
            workload="synthetic",
            input_len=24,
            output_len=4,
            num_prompts=3,
            concurrency=[],
            warmup=0,
        )
    )
    wl = res.manifest["workload"]
    assert wl["tokenizer"] == checkpoint_factory("qwen3")
    recs = [r for r in res.records if r.ok]
    assert len(recs) == 3
    assert sum(r.prompt_tokens for r in recs) / 3 == wl["buckets"]["synthetic"]["input_tokens_mean"]
