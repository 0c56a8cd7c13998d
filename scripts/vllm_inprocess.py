"""vLLM in-process, one model loaded once, measured on request: scripts/bench_peer.py's vLLM worker.

Run by the vLLM venv's python (leverlab.bench.peer_vllm.python()), never ours: vLLM pins its own packages. The
parent sets the thread binding in the environment (peer_vllm.server_env) before this process starts, since vLLM
reads it when its engine starts. The worker stays alive across bench_peer's rounds, so vLLM's figures interleave
with ours the way llama.cpp's tools do, and loads (and compiles) each model only once.

Protocol, JSON lines: the worker writes {"ready": {...}} once the model is loaded and warmed (or {"error": ...}
and exits 1); then for each request line {"measure": "decode" | "decode16" | "prefill", "prompts": [[ids], ..],
"decode_len": N} it writes {"tok_s": x, "timing": "engine" | "wall"} (or {"error": ...} and goes on); an empty
line, {"quit": true} or the end of stdin ends it. The protocol owns the process's stdout: vLLM's own logging is
sent to stderr (fd 1 is pointed at fd 2 before vLLM is imported, so its engine process inherits that too).

    <vllm python> scripts/vllm_inprocess.py --model DIR [--max-model-len N] [--max-num-seqs 16]
        [--max-num-batched-tokens N] [--kv-cache-bytes N] [--warm-prompt-len 128] [--warm-rows 16]
        [--prefill-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def decode_rate(outs) -> tuple[float, str] | None:
    """(tok/s, "engine") from vLLM's per-request engine timestamps, or None where it kept none. As ours
    (bench_decode.aggregate_decode): the tokens after every sequence had its first token, over that span, so
    prefill stays out. vLLM keeps a request's first and last token times, not each token's: the tokens a sequence
    made after that point are counted pro rata over its own first -> last span (exact for one sequence, and for a
    batch whose first tokens came in one step)."""
    stats = [(len(o.outputs[0].token_ids), getattr(o, "metrics", None)) for o in outs]
    if not stats or any(m is None or not getattr(m, "first_token_ts", 0) or not getattr(m, "last_token_ts", 0)
                        for _, m in stats):
        return None
    start = max(m.first_token_ts for _, m in stats)
    end = max(m.last_token_ts for _, m in stats)
    if end <= start:
        return None
    decoded = 0.0
    for n, m in stats:
        span = m.last_token_ts - m.first_token_ts
        if n > 1 and span > 0 and m.last_token_ts > start:
            decoded += (n - 1) * (m.last_token_ts - start) / span
    return decoded / (end - start), "engine"


def measure(generate, key: str, prompts: list[list[int]], decode_len: int) -> dict:
    """One measurement; `generate(prompts, max_tokens)` -> (vLLM's RequestOutputs, wall seconds).
    prefill: prompt tokens over the time to the first token of a cold prompt (prefix caching is off), vLLM's own
    first-token latency where it kept one, else the wall time of a one-token generate. decode / decode16: see
    decode_rate; without engine timestamps, the wall time of a one-token generate of the same prompts is
    subtracted from a full one's (tokens after the first over the rest)."""
    if key == "prefill":
        outs, wall = generate(prompts, 1)
        lat = getattr(outs[0].metrics, "first_token_latency", 0) if getattr(outs[0], "metrics", None) else 0
        return {"tok_s": len(prompts[0]) / (lat or wall), "timing": "engine" if lat else "wall"}
    if key not in ("decode", "decode16"):
        raise ValueError(f"unknown measurement {key!r}")
    outs, wall = generate(prompts, decode_len)
    rate = decode_rate(outs)
    if rate is not None:
        return {"tok_s": rate[0], "timing": rate[1]}
    _, first = generate(prompts, 1)
    made = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return {"tok_s": made / max(1e-9, wall - first), "timing": "wall"}


def serve(generate, lines, write) -> None:
    """The request loop: each line of `lines` a request, each reply given to `write` as one dict."""
    for line in lines:
        line = line.strip()
        if not line:
            return
        try:
            req = json.loads(line)
            if req.get("quit"):
                return
            write(measure(generate, req["measure"], req["prompts"], int(req.get("decode_len", 64))))
        except Exception as e:  # one bad request is reported, the worker goes on (the parent decides)
            write({"error": f"{type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-bytes", type=int, default=None, help="vLLM's KV pool (default: its own sizing)")
    ap.add_argument("--warm-prompt-len", type=int, default=128)
    ap.add_argument("--warm-rows", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=128)
    a = ap.parse_args(argv)
    # SIGTERM as an exit, so that vLLM's exit handlers stop its engine process (killed outright, the worker would
    # leave it running, orphaned).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # The protocol keeps the real stdout; everything else printed to fd 1 (vLLM's logs, its engine process's,
    # a library's print) goes to stderr, where the parent keeps it as a log.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def write(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import vllm
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        extra = {"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}
        if a.kv_cache_bytes:
            extra["kv_cache_memory_bytes"] = a.kv_cache_bytes
        # disable_log_stats=False: vLLM keeps per-request timestamps (RequestOutput.metrics) only with stats on.
        llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                  enable_prefix_caching=False, disable_log_stats=False, **extra)

        def generate(prompts, max_tokens):
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return outs, time.perf_counter() - t

        # Every shape the rounds use, once, so first-call costs (compiles, allocations) stay out of the figures.
        generate([[7] * a.warm_prompt_len] * a.warm_rows, 4)
        generate([[7] * a.prefill_len], 4)
        outs, _ = generate([[7] * 8], 2)
        ready = {"setup_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                 "engine_timestamps": decode_rate(outs) is not None,
                 "bind": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                         "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")}}
    except Exception as e:
        write({"error": f"{type(e).__name__}: {e}"})
        return 1
    write({"ready": ready})
    serve(generate, sys.stdin, write)
    return 0


if __name__ == "__main__":  # the guard vLLM needs: it spawns its engine process, which imports this module
    sys.exit(main())
