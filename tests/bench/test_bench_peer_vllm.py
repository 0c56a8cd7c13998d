"""scripts/bench_peer.py with vLLM as a peer, and its in-process worker (scripts/vllm_inprocess.py): everything that
runs without vLLM. The worker's protocol is driven end to end against a stand-in `vllm` module (fake_vllm/)."""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from leverlab.config import default_model_path

ROOT = Path(__file__).resolve().parents[2]
FAKE_VLLM = Path(__file__).parent / "fake_vllm"


@pytest.fixture
def bench_peer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("bench_peer")


def _args(bench_peer, *argv):
    return bench_peer.parse_args(["--model", str(default_model_path()), *argv])


def test_peers_argument(bench_peer):
    assert _args(bench_peer).peers == ["llamacpp"]  # today's default
    assert _args(bench_peer, "--peers", "vllm").peers == ["vllm"]
    args = _args(bench_peer, "--peers", "llamacpp,vllm,llamacpp")
    assert args.peers == ["llamacpp", "vllm"] and bench_peer.engines(args) == ["leverlab", "llamacpp", "vllm"]
    for bad in ("sglang", ","):
        with pytest.raises(SystemExit):
            _args(bench_peer, "--peers", bad)


def test_ttft_best_is_the_least_and_its_ratio_is_theirs_over_ours(bench_peer):
    best: dict = {}
    for v in (120.0, 90.0, None, 110.0):
        bench_peer.keep_best(best, "bf16", "vllm", "server_ttft512", v)
        bench_peer.keep_best(best, "bf16", "vllm", "decode", v)
    assert best["bf16"]["server_ttft512"]["vllm"] == 90.0 and best["bf16"]["decode"]["vllm"] == 120.0
    assert bench_peer.speed_ratio("server_ttft512", 60.0, 90.0) == pytest.approx(1.5)  # ours 1.5x faster
    assert bench_peer.speed_ratio("decode", 60.0, 90.0) == pytest.approx(2 / 3)
    assert bench_peer.speed_ratio("decode", None, 90.0) is None


def test_table_with_three_engines(bench_peer, capsys):
    args = _args(bench_peer, "--peers", "llamacpp,vllm", "--precisions", "bf16", "--measurements", "decode",
                 "--rounds", "1")
    best = {"bf16": {"decode": {"leverlab": 100.0, "llamacpp": 50.0, "vllm": 25.0},
                     "server_c1": {"leverlab": 90.0, "vllm": 30.0},
                     "server_ttft1500": {"leverlab": 200.0, "llamacpp": 300.0, "vllm": 100.0}}}
    wb = {"bf16": {"leverlab": 10**7, "llamacpp": 10**7, "vllm": None}}
    bench_peer.print_table(best, wb, 10.0, args, {"bf16": {"llamacpp": "BF16", "vllm": "bf16"}},
                           {"leverlab": "--threads 1", "llamacpp": "-t 1", "vllm": "VLLM_CPU_OMP_THREADS_BIND=0"})
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0] == ("| precision | measurement | unit | LeverLab | llama.cpp | LeverLab / llama.cpp | vLLM | "
                        "LeverLab / vLLM | LeverLab % roofline | llama.cpp % roofline | vLLM % roofline |")
    rows = {ln.split(" | ")[1]: ln.strip("| ").split(" | ") for ln in lines[2:]}
    assert "prefill" not in rows  # not asked for and not measured
    kv = args.kv_bytes_per_token * bench_peer.decode_context(args)
    share = lambda v: f"{100 * v * (10**7 + kv) / 10e9:.0f}%"  # noqa: E731
    assert rows["decode, 1 sequence"][2:] == ["tok/s", "100.0", "50.0", "2.00x", "25.0", "4.00x", share(100.0),
                                              share(50.0), "-"]
    assert rows["server decode, c=1"][4:8] == ["missing", "-", "30.0", "3.00x"]
    # TTFT in ms, and the ratio says how many times faster ours is: 300 / 200 against llama.cpp, 100 / 200 vLLM
    assert rows["server TTFT, 1,500 tokens"][2:8] == ["ms", "200", "300", "1.50x", "100", "0.50x"]
    assert "llama.cpp 10.0 MB (BF16), vLLM ? (bf16)" in out and "vLLM VLLM_CPU_OMP_THREADS_BIND=0" in out


def test_block_shares_and_precision_ratios_name_every_peer(bench_peer, capsys):
    args = _args(bench_peer, "--peers", "vllm,llamacpp", "--precisions", "bf16,int4", "--rounds", "1",
                 "--measurements", "decode", "--prompt-len", "0", "--decode-len", "0")
    rounds = [{"round": 1, "precision": p, "measurement": "bandwidth", "gb_s": 20.0} for p in ("bf16", "int4")]
    rate = {("bf16", "leverlab"): 40.0, ("bf16", "vllm"): 20.0, ("int4", "leverlab"): 80.0, ("int4", "vllm"): 30.0}
    rounds += [{"round": 1, "precision": p, "engine": e, "measurement": "decode", "tok_s": v} for (p, e), v in
               rate.items()]
    wb = {p: {"leverlab": 4 * 10**8, "vllm": 4 * 10**8, "llamacpp": None} for p in ("bf16", "int4")}
    bench_peer.print_block_shares(rounds, wb, args)
    assert "LeverLab 160%, vLLM 60%, llama.cpp -" in capsys.readouterr().out
    best: dict = {}
    for r in rounds[2:]:
        bench_peer.keep_best(best, r["precision"], r["engine"], "decode", r["tok_s"])
    ratios = bench_peer.precision_ratios(rounds, best, args)["int4"]
    assert ratios["leverlab"]["best"] == pytest.approx(2.0) and ratios["vllm"]["best"] == pytest.approx(1.5)
    assert ratios["llamacpp"]["best"] is None


class FakePeer:
    """A peer that records what it was asked; like llama.cpp's tools, it may lack an in-process measurement."""

    def __init__(self, name, log, in_process=("decode", "prefill", "decode16")):
        self.name, self.log, self.in_process = name, log, in_process

    def measure(self, key, prec, prompts, args):
        self.log.append((self.name, key, len(prompts), len(prompts[0])))
        return 10.0, {"timing": "fake"}


def test_rounds_interleave_ours_and_the_peers(bench_peer, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_peer, "measure_bandwidth", lambda *a, **k: 10.0)
    monkeypatch.setattr(bench_peer, "thread_scaling", lambda *a, **k: None)
    args = _args(bench_peer, "--peers", "llamacpp,vllm", "--precisions", "bf16", "--rounds", "2", "--no-servers",
                 "--measurements", "decode,prefill", "--prompt-len", "12", "--prefill-len", "20")
    log: list = []
    ours = SimpleNamespace(measure=lambda key, prompts: log.append(("leverlab", key, len(prompts),
                                                                   len(prompts[0]))) or 20.0)
    peers = {"llamacpp": FakePeer("llamacpp", log, ("decode",)), "vllm": FakePeer("vllm", log)}
    rounds: list = []
    best = bench_peer.run_rounds(args, {"bf16": ours}, peers, rounds, tmp_path)
    assert [e for e, k, *_ in log if k == "decode"] == ["leverlab", "llamacpp", "vllm", "vllm", "llamacpp",
                                                        "leverlab"]
    assert [e for e, k, *_ in log if k == "prefill"] == ["leverlab", "vllm", "vllm", "leverlab"]
    assert {(k, n, ln) for _, k, n, ln in log} == {("decode", 1, 12), ("prefill", 1, 20)}
    assert best["bf16"]["prefill"] == {"leverlab": 20.0, "vllm": 10.0}
    assert [r["raw"] for r in rounds if r.get("engine") == "vllm"][0] == {"timing": "fake"}


def test_vllm_peer_folders_bytes_server_and_binding(bench_peer, monkeypatch, tmp_path):
    """bf16 is the checkpoint itself; the server runs with our thread binding and no prefix cache; a folder's
    weight bytes are its safetensors' tensor bytes (headers read, data not)."""
    header = json.dumps({"__metadata__": {}, "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
                         "b": {"dtype": "I8", "shape": [10], "data_offsets": [24, 34]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(34))
    assert bench_peer.safetensors_bytes(tmp_path) == 34
    assert bench_peer.peer_vllm.quantized_folder(tmp_path, "bf16") == tmp_path
    monkeypatch.setattr(bench_peer.peer_vllm, "python", lambda root=None: Path("/venv/bin/python"))
    monkeypatch.setattr(bench_peer.peer_vllm, "quantized_folder", lambda model, p: tmp_path)
    args = _args(bench_peer, "--peers", "vllm", "--precisions", "bf16,int4", "--threads", "1")
    v = bench_peer.Vllm()
    info = v.prepare(args)
    assert info["folders"] == {"bf16": str(tmp_path), "int4": str(tmp_path)}
    assert v.weight_bytes("int4") == 34 and v.format_of("int4").startswith("AWQ")
    cmd, env = v.server("bf16", 8123, args)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in cmd and cmd[cmd.index("--max-num-seqs") + 1] == "16"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in v.binding(args)
    wc = [str(c) for c in v.worker_command("bf16", args)]
    assert wc[1].endswith("vllm_inprocess.py") and wc[wc.index("--max-model-len") + 1] == str(128 + 64 + 16)
    # the workers' KV pool sized in bytes for 16 sequences, not the server's whole GiB
    assert int(wc[wc.index("--kv-cache-bytes") + 1]) == max(64 << 20, int(1.5 * 16 * 208 * args.kv_bytes_per_token))
    assert "VLLM_CPU_KVCACHE_SPACE" not in v.worker_env(args) and v.worker_env(args)["VLLM_CPU_OMP_THREADS_BIND"]
    monkeypatch.setattr(bench_peer.peer_vllm, "python", lambda root=None: None)
    with pytest.raises(bench_peer.PeerUnavailable, match="peer_vllm install"):
        bench_peer.Vllm().prepare(args)


def _worker(bench_peer, tmp_path, start_timeout=120, **env):
    e = {**os.environ, "PYTHONPATH": str(FAKE_VLLM), **env}
    cmd = [sys.executable, ROOT / "scripts" / "vllm_inprocess.py", "--model", "m", "--warm-rows", "2"]
    return bench_peer.VllmWorker(cmd, e, tmp_path / "worker.log", start_timeout)


def test_worker_protocol_against_a_stand_in_vllm(bench_peer, tmp_path):
    w = _worker(bench_peer, tmp_path)
    try:
        assert w.ready["vllm"] == "0.0.fake" and w.ready["engine_timestamps"] is True
        one = w.measure("decode", [[5] * 16], 64)
        assert one == {"tok_s": pytest.approx(100.0), "timing": "engine"}
        assert w.measure("decode16", [[5] * 16] * 16, 64)["tok_s"] == pytest.approx(1600.0)
        assert w.measure("prefill", [[5] * 100], 64)["tok_s"] == pytest.approx(10000.0)
        with pytest.raises(RuntimeError, match="unknown measurement"):
            w.measure("bogus", [[1]], 4)
        assert w.measure("decode", [[5] * 4], 8)["tok_s"] == pytest.approx(100.0)  # it goes on after an error
    finally:
        w.close()
    assert w.proc.returncode == 0
    assert "fake vllm imported" in (tmp_path / "worker.log").read_text()  # vLLM's stdout went to the log


def test_worker_without_engine_timestamps_times_the_wall_clock(bench_peer, tmp_path):
    w = _worker(bench_peer, tmp_path, FAKE_VLLM_NO_METRICS="1")
    try:
        assert w.ready["engine_timestamps"] is False
        r = w.measure("decode", [[5] * 16], 11)  # 0.15 s against 0.05 s for one token: 10 tokens in 0.1 s
        assert r["timing"] == "wall" and 50 < r["tok_s"] < 150  # sleeps on a shared machine: loose
    finally:
        w.close()


def test_worker_load_failure_is_reported(bench_peer, tmp_path):
    with pytest.raises(RuntimeError, match="fake load failure"):
        _worker(bench_peer, tmp_path, FAKE_VLLM_FAIL="1")


def test_decode_rate_counts_tokens_after_every_first_token(monkeypatch):
    """Sequences whose first tokens came at different times: each one's tokens after the last first token, pro
    rata over its own span; no timestamps, no rate."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    vi = importlib.import_module("vllm_inprocess")
    out = lambda n, first, last: SimpleNamespace(  # noqa: E731
        outputs=[SimpleNamespace(token_ids=[0] * n)], metrics=SimpleNamespace(first_token_ts=first, last_token_ts=last))
    # a: 11 tokens over 10..11 s, b: 11 over 10.5..11.5 s; from 10.5 s on: a made 5, b 10, in 1 s (vLLM's
    # timestamps are its engine's monotonic clock, 0 where it kept none)
    assert vi.decode_rate([out(11, 10.0, 11.0), out(11, 10.5, 11.5)]) == (pytest.approx(15.0), "engine")
    assert vi.decode_rate([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0])], metrics=None)]) is None


def test_worker_stuck_in_its_load_is_stopped(bench_peer, tmp_path, monkeypatch):
    """A load that never answers raises after the start timeout, and the worker's whole session is gone."""
    started = []
    real = bench_peer.subprocess.Popen
    monkeypatch.setattr(bench_peer.subprocess, "Popen", lambda *a, **k: started.append(real(*a, **k)) or started[-1])
    with pytest.raises(RuntimeError, match="no answer in 3 s"):
        _worker(bench_peer, tmp_path, start_timeout=3, FAKE_VLLM_HANG="1")
    assert started[0].poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(started[0].pid, 0)


def test_a_mixture_of_experts_step_reads_the_experts_its_router_chose(bench_peer, checkpoint_factory):
    """bench_peer on a mixture of experts: ours counts the experts per sparse layer its router chose in each decode
    measurement; a step's weight bytes are every weight but the routed experts it did not read, which for ours at one
    sequence are exactly the bytes the engine counted per decode pass (its /metrics figure)."""
    from bench_quant import step_weight_bytes

    path = checkpoint_factory("qwen3-moe")  # 8 experts, 2 per token, 3 sparse layers
    args = bench_peer.parse_args(["--model", path, "--precisions", "bf16", "--measurements", "decode,decode16",
                                  "--batch", "3", "--prompt-len", "16", "--decode-len", "8", "--prefill-len", "16",
                                  "--execution-mode", "eager"])
    assert {k: args.moe[k] for k in ("experts", "top_k")} == {"experts": 8, "top_k": 2}
    eng = bench_peer.OursEngine(path, "bf16", args)
    reads = eng.llm.engine.runner.expert_reads
    passes, read = reads.passes, reads.bytes
    _, hit1 = eng.measure("decode", [list(range(20, 36))], args.decode_len)
    per_pass = (reads.bytes - read) / (reads.passes - passes)
    _, hit3 = eng.measure("decode16", [list(range(20 + i, 36 + i)) for i in range(3)], args.decode_len)
    assert hit1 == 2 and 2 <= hit3 <= 6
    args.moe["routed_bytes"] = {"bf16": {"leverlab": eng.routed_bytes, "llamacpp": 8000}}
    args.moe["hits"] = {"bf16": {1: hit1, 3: hit3}}
    assert bench_peer.step_weights(args, "bf16", "leverlab", 1, eng.weight_bytes) == per_pass
    assert per_pass == step_weight_bytes(eng.llm.engine.runner.model, 1)  # bench_quant's count: top-k by default
    at3 = bench_peer.step_weights(args, "bf16", "leverlab", "batch", eng.weight_bytes)
    assert at3 == pytest.approx(eng.weight_bytes - eng.routed_bytes * (1 - hit3 / 8))
    # A peer: its own routed tensors' bytes, at the share our router read; unmeasured, top-k at one sequence
    assert bench_peer.step_weights(args, "bf16", "llamacpp", "batch", 10_000) == pytest.approx(
        10_000 - 8000 * (1 - hit3 / 8))
    args.moe["hits"] = {}
    assert bench_peer.step_weights(args, "bf16", "llamacpp", 1, 10_000) == 10_000 - 8000 * 6 / 8
    assert bench_peer.step_weights(args, "bf16", "vllm", 1, 10_000) == 10_000  # its experts' bytes unknown
