"""Tensor-parallel benchmark (issue 9): TP=1 with T threads against TP=2 with T/2 threads per rank, one run.

Both engines live side by side (the TP=2 worker idles in its broadcast while TP=1 runs) and are measured in
interleaved rounds, the best round of each counting, so a noisy spell hits both alike. Prints decode tok/s
single-stream and at batch 16, the TP=2 / TP=1 ratio, the share of each TP=2 step spent in all-reduces
(from the engine's counters: tp_allreduce_seconds / the decode time), the share of the bandwidth roofline,
and what the measured number of all-reduces per step predicts for GPUs joined by NVLink.

    python scripts/bench_tp.py [--model DIR] [--threads 2] [--decode-len 128] [--batches 1,16] [--mode compiled]
    python scripts/bench_tp.py --mode eager --decode-len 4 --prompt-len 16 --rounds 1    # a quick smoke run
    python scripts/bench_tp.py --model /tmp/moe-decode/shape3 --mode eager ...   # the MoE shape (bench_moe_decode.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import aggregate_decode, measure_all  # noqa: E402

from leverlab.study.bandwidth import measure_bandwidth  # noqa: E402

COMM = ("tp_allreduce_seconds", "tp_gather_seconds", "tp_broadcast_seconds", "tp_allreduces", "tp_steps")


class Engine:
    def __init__(self, path: str, tp: int, threads: int, args):
        from leverlab import LLM, SamplingParams

        self.name, self.tp, self.threads = f"TP={tp} ({threads} thread{'s' if threads > 1 else ''}/rank)", tp, threads
        t0 = time.perf_counter()
        self.llm = LLM(path, dtype=args.dtype, execution_mode=args.mode, tensor_parallel_size=tp, num_threads=threads,
                       max_num_seqs=max(args.batches), max_num_batched_tokens=max(512, args.prompt_len),
                       max_model_len=args.prompt_len + args.decode_len + 16)
        self.setup_s = time.perf_counter() - t0
        self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def measure(self, prompts: list[list[int]], decode_len: int) -> dict:
        torch.set_num_threads(self.threads)  # per process: the two engines share this one
        before = self.llm.engine.counter_snapshot()
        outs = self.llm.generate(prompts, self.params(decode_len))
        after = self.llm.engine.counter_snapshot()
        tok_s, span = aggregate_decode(outs)
        res = {"decode_tok_s": tok_s, "ttft_s": max(o.metrics.ttft for o in outs), "span_s": span}
        # Communication over the whole generate (prefill included): shares of its wall time.
        total = max(1e-9, max(o.metrics.finished_time for o in outs) - min(o.metrics.arrival_time for o in outs))
        for k in COMM:
            res[k] = after.get(k, 0) - before.get(k, 0)
        res["allreduce_share"] = res["tp_allreduce_seconds"] / total
        res["comm_share"] = (res["tp_allreduce_seconds"] + res["tp_gather_seconds"] + res["tp_broadcast_seconds"]) / total
        return res

    def close(self) -> None:
        self.llm.engine.close()


def gpu_prediction(allreduces_per_step: float, weight_bytes: float, args) -> list[str]:
    """What TP=2 would do on two GPUs joined by NVLink, from this model's all-reduces per step."""
    t_read = weight_bytes / (args.gpu_bandwidth_tbs * 1e12)  # one GPU reads all weights at batch 1
    t_tp = t_read / 2 + allreduces_per_step * args.nvlink_allreduce_us * 1e-6
    return [
        f"On GPUs: one decode step reads {weight_bytes / 1e9:.2f} GB of weights, {1e3 * t_read:.2f} ms at "
        f"{args.gpu_bandwidth_tbs} TB/s; TP=2 halves that but adds {allreduces_per_step:.0f} all-reduces per step "
        f"(2 per layer + the embedding), about {args.nvlink_allreduce_us:.0f} us each over NVLink for a few KB "
        f"(latency-bound, not bandwidth-bound): {1e3 * t_tp:.2f} ms per step, a predicted "
        f"{t_read / t_tp:.2f}x at batch 1 (kernel launches and the sampler not counted).",
        "The all-reduce payload is batch x hidden activations, tiny next to the weights, so its cost is a fixed "
        "latency per layer: TP pays on GPUs once a step's weight read per GPU is long against ~2 x layers x "
        "that latency (multi-GB models), and costs more than it saves on a model this small. On this CPU, both "
        "ranks share one memory system: TP cannot add bandwidth, it only adds the all-reduces measured above.",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "qwen3-0.6b-shape"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", default="compiled", choices=("compiled", "eager"))
    ap.add_argument("--threads", type=int, default=2, help="TP=1 threads; TP=2 gets threads // 2 per rank")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best counts")
    ap.add_argument("--gpu-bandwidth-tbs", type=float, default=3.35, help="HBM bandwidth for the GPU prediction")
    ap.add_argument("--nvlink-allreduce-us", type=float, default=15.0,
                    help="latency of one small NCCL all-reduce over NVLink, for the GPU prediction")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_tp.json"))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    from make_qwen3_06b_shape import make

    from leverlab.models.config import ModelConfig

    path = str(make(Path(args.model)))
    cfg = ModelConfig.from_folder(path)
    bw = measure_bandwidth(args.threads)
    weight_bytes = cfg.weight_bytes(torch.finfo(getattr(torch, args.dtype)).bits / 8)
    roof = bw * 1e9 / weight_bytes  # both ranks read through the same memory: the same roofline for TP=2
    print(f"model {path}: {cfg.num_params() / 1e6:.0f}M params, {weight_bytes / 1e9:.2f} GB of weights per step")
    print(f"memory bandwidth {bw:.1f} GB/s with {args.threads} threads -> roofline {roof:.1f} tok/s at batch 1",
          flush=True)
    engines = [Engine(path, 1, args.threads, args), Engine(path, 2, max(1, args.threads // 2), args)]
    for e in engines:
        print(f"{e.name}: load + warm-up {e.setup_s:.1f} s", flush=True)
    try:
        best = measure_all(engines, args.prompt_len, args.decode_len, args.batches, args.rounds,
                           lambda res: f"decode {res['decode_tok_s']:.1f} tok/s, "
                                       f"all-reduce {100 * res['allreduce_share']:.0f}% of the time",
                           vocab=cfg.vocab_size)
    finally:
        for e in engines:
            e.close()
    one, two = (best[e.name] for e in engines)
    print("\n| batch | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 | all-reduce share (TP=2) | all comm share | "
          "all-reduce per step | TP=1 % roofline | TP=2 % roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        a, t = one[b], two[b]
        per_step = t["tp_allreduce_seconds"] / max(1, t["tp_steps"])
        print(f"| {b} | {a['decode_tok_s']:.1f} | {t['decode_tok_s']:.1f} | {t['decode_tok_s'] / a['decode_tok_s']:.2f}x "
              f"| {100 * t['allreduce_share']:.0f}% | {100 * t['comm_share']:.0f}% | {1e3 * per_step:.2f} ms "
              f"| {100 * a['decode_tok_s'] / (roof * b):.0f}% | {100 * t['decode_tok_s'] / (roof * b):.0f}% |")
    t1 = two[args.batches[0]]
    per_step_n = t1["tp_allreduces"] / max(1, t1["tp_steps"])
    print()
    for line in gpu_prediction(per_step_n, weight_bytes, args):
        print(line)
    result = {"model": path, "dtype": args.dtype, "mode": args.mode, "threads": args.threads, "bandwidth_gb_s": bw,
              "roofline_tok_s": roof, "tp1": one, "tp2": two, "setup_s": {e.name: e.setup_s for e in engines}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
