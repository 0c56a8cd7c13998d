"""Replicas benchmark (issue 19): `leverlab serve --data-parallel-size 2` against one replica, one run.

For each of DP=1 and DP=2 it starts a real server on the bundled model (or --model), then drives it with the
`leverlab bench` harness over HTTP: the medium bucket (512 tokens in, output length fixed by the bucket or
--output-len, ignore_eos), closed loop at concurrency 16, then at concurrency 1. It prints output tokens/s and
P50 latency for both, the DP=2 / DP=1 ratios against the issue's bar (>= 1.6x tokens/s at c=16 with P50 not
worse; no slower at c=1), and the CPU seconds the server's process tree spent per 1,000 output tokens
(/proc: utime + stime of the server and its replicas), a figure that a busy machine disturbs less than wall
time, and the cores the client (this process) and the server's own process took. Then, with --ceiling, what two
replicas could make at best here: in this process, no server, no client, no prefix caching, one engine on one
thread decodes the bucket's prompts in batches of 8 and of 16, alternating; two replicas of 8 on two cores to
themselves make at most 2 x rate(8), so 2 x rate(8) / rate(16) bounds DP=2 / DP=1 at c=16, and less what the
client and the front process take of the two cores.

    python scripts/bench_replicas.py [--model DIR] [--num-prompts N] [--rounds 4] [--output-len N] [--ceiling]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from server_proc import free_port, stop, wait_ready  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _stat(proc: Path) -> tuple[int, float]:
    """(parent pid, CPU seconds: user + system) from /proc/<pid>/stat."""
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def own_cpu_s(pid: int) -> float:
    """CPU seconds of pid alone (with DP=2, the front process: HTTP, routing, streaming)."""
    return _stat(Path("/proc") / str(pid))[1]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of pid and every live descendant."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)], cpu[int(d.name)] = _stat(d)
        except OSError:
            continue
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        total += cpu.get(p, 0.0)
        stack.extend(c for c, pp in parent.items() if pp == p)
    return total


def start_server(model: str, dp: int, dtype: str, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "leverlab.cli", "serve", model, "--port", str(port), "--dtype", dtype,
           "--data-parallel-size", str(dp), "--disable-log-requests"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if not wait_ready(proc, port, 600):
        code = proc.poll()
        stop(proc)
        raise SystemExit(f"server (DP={dp}) exited with {code}; log: {log.name}" if code is not None
                         else f"server (DP={dp}) not healthy after 600 s; log: {log.name}")
    return proc, f"http://127.0.0.1:{port}"


def measure(url: str, pid: int, c: int, args) -> dict:
    from leverlab.bench import BenchConfig, run_benchmark

    cfg = BenchConfig(base_url=url + "/v1", buckets=["medium"], sweep_bucket="medium", single=False,
                      concurrency=[c], sweep_rounds=args.rounds, num_prompts=args.num_prompts,
                      output_len=args.output_len, warmup=2, scrape_metrics=False)
    cpu0, front0, me0, wall0 = tree_cpu_s(pid), own_cpu_s(pid), time.process_time(), time.monotonic()
    res = run_benchmark(cfg)  # the client runs here, in this process
    cpu = tree_cpu_s(pid) - cpu0  # the warm-up requests included: a small, equal share for both settings
    wall = time.monotonic() - wall0
    side_cores = (own_cpu_s(pid) - front0 + time.process_time() - me0) / wall
    g = res.group(f"sweep/medium/c{c}")
    out = g["total_output_tokens"]
    return {"tok_s": g["output_throughput"], "p50_s": g["e2e_s"]["p50"], "errors": g["errors"],
            "out": out, "cpu_per_1k": 1000 * cpu / out if out else float("nan"),
            "mismatches": g["output_len_mismatches"], "side_cores": side_cores}


def ceiling(model: str, dtype: str, output_len: int | None, rounds: int = 3) -> tuple[float, float]:
    """Decode rates (output tok/s, best of `rounds`) of one engine on one thread over the medium bucket's prompts
    in batches of 8 and of 16: the most a replica of each size makes with a core to itself."""
    import json

    from leverlab import LLM, SamplingParams

    bucket = json.loads((ROOT / "models" / "workload.json").read_text())["buckets"]["medium"]
    texts = [p["text"] for p in bucket["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=output_len or bucket["output_len"], ignore_eos=True)
    # No prefix caching: a batch's prompts met again in a later round would skip their prefill and flatter it.
    llm = LLM(model, dtype=dtype, num_threads=1, max_num_seqs=16, enable_prefix_caching=False)
    llm.generate(texts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    best = {8: 0.0, 16: 0.0}
    for r in range(rounds):
        for n in (8, 16) if r % 2 == 0 else (16, 8):
            batch = texts[(r * n) % len(texts):][:n]
            t = time.perf_counter()
            outs = llm.generate(batch, params)
            best[n] = max(best[n], sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    llm.close()
    return best[8], best[16]


def main() -> int:
    from leverlab.config import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="medium-bucket prompts, cycled (default: the whole bucket, as `leverlab bench`)")
    ap.add_argument("--rounds", type=int, default=4, help="requests per level: max(prompts, rounds x c)")
    ap.add_argument("--output-len", type=int, default=None, help="fixed output length (default: the bucket's)")
    ap.add_argument("--ceiling", action="store_true", help="also measure what two replicas could make at best here")
    args = ap.parse_args()

    results: dict[tuple[int, int], dict] = {}
    for dp in (1, 2):
        with tempfile.NamedTemporaryFile("wb", prefix=f"bench-replicas-dp{dp}-", suffix=".log", delete=False) as log:
            proc, url = start_server(args.model, dp, args.dtype, log)
            try:
                for c in (16, 1):
                    results[(dp, c)] = r = measure(url, proc.pid, c, args)
                    print(f"DP={dp} c={c:<2}: {r['tok_s']:7.1f} out tok/s, P50 {r['p50_s']:6.2f} s, "
                          f"{r['cpu_per_1k']:5.2f} CPU s / 1k tokens (server), client + {'front' if dp > 1 else 'server'} "
                          f"process {r['side_cores']:.2f} cores, {r['errors']} errors, "
                          f"{r['mismatches']} length mismatches", flush=True)
            finally:
                stop(proc, grace_s=60)

    print(f"\nmodel {args.model}, medium bucket, {os.cpu_count()} cores; DP=2 / DP=1:")
    bars = []
    for c in (16, 1):
        a, b = results[(1, c)], results[(2, c)]
        tput, p50 = b["tok_s"] / a["tok_s"], b["p50_s"] / a["p50_s"]
        print(f"  c={c:<2}: output tok/s {tput:.2f}x, P50 latency {p50:.2f}x, CPU s per 1k tokens "
              f"{b['cpu_per_1k'] / a['cpu_per_1k']:.2f}x")
        bars += [(f"c=16 tok/s >= 1.6x ({tput:.2f}x)", tput >= 1.6), (f"c=16 P50 not worse ({p50:.2f}x)", p50 <= 1.0)] \
            if c == 16 else [(f"c=1 no slower (tok/s {tput:.2f}x)", tput >= 1.0)]
    for what, ok in bars:
        print(f"  bar: {what}: {'met' if ok else 'NOT met'}")
    if args.ceiling:
        r8, r16 = ceiling(args.model, args.dtype, args.output_len)
        side = results[(2, 16)]["side_cores"]
        best = 2 * r8 / r16
        print(f"\nin process, one engine on one thread, no server, no client, no prefix caching: batch 8 {r8:.1f} "
              f"tok/s, batch 16 {r16:.1f}. Two replicas of 8 with both cores to themselves: at most {best:.2f}x one "
              f"engine of 16. At c=16 with DP=2 the client and the front process took {side:.2f} of the "
              f"{os.cpu_count()} cores (measured above), leaving the replicas {os.cpu_count() - side:.2f}: at most "
              f"{best * (os.cpu_count() - side) / os.cpu_count():.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
