"""Decode benchmark (issue 2): LeverLab against transformers on a Qwen3-0.6B-shaped checkpoint, in one run.

Prints single-stream prefill and decode rates, aggregate decode at 8 and 16 concurrent sequences, the
machine's measured memory bandwidth and each decode rate as a share of the bandwidth roofline
(weight bytes read per step / bandwidth). Ratios are what to compare: these machines are shared and noisy.

    python scripts/bench_decode.py [--model DIR] [--dtype bfloat16] [--prompt-len 128] [--decode-len 128]
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


def measure_bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in GB/s: the best of a few full passes summing a tensor far larger than the caches."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def bench_transformers(path: str, dtype: torch.dtype, prompt_len: int, decode_len: int, batches: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    res = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(100, 1000, (b, prompt_len))
            kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=decode_len, min_new_tokens=decode_len, **kw)
            total = time.perf_counter() - t0
            decode = max(1e-9, total - ttft)
            res[b] = {"ttft_s": ttft, "prefill_tok_s": b * prompt_len / ttft,
                      "decode_tok_s": b * (decode_len - 1) / decode}
            print(f"  transformers batch {b:2d}: TTFT {ttft:.2f} s, decode {res[b]['decode_tok_s']:.1f} tok/s", flush=True)
    return res


def bench_leverlab(path: str, dtype: str, prompt_len: int, decode_len: int, batches: list[int], mode: str) -> dict:
    from leverlab import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(path, dtype=dtype, execution_mode=mode, max_num_seqs=max(batches),
              max_num_batched_tokens=max(512, prompt_len), max_model_len=prompt_len + decode_len + 16)
    params = SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)
    llm.generate([[7] * prompt_len] * max(batches), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.generate([[7] * prompt_len], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    setup = time.perf_counter() - t0
    res = {"setup_s": setup}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(100, 1000, (prompt_len,), generator=g).tolist() for _ in range(b)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        ttft = max(o.metrics.ttft for o in outs)
        # Aggregate decode: tokens produced after every sequence had its first token, over that span.
        start = max(o.metrics.first_token_time for o in outs)
        end = max(o.metrics.last_token_time for o in outs)
        decoded = sum(1 for o in outs for t in o.metrics.token_times if t > start)
        res[b] = {"ttft_s": ttft, "prefill_tok_s": b * prompt_len / ttft,
                  "decode_tok_s": decoded / max(1e-9, end - start), "wall_s": wall}
        print(f"  leverlab({mode}) batch {b:2d}: TTFT {ttft:.2f} s, decode {res[b]['decode_tok_s']:.1f} tok/s",
              flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "qwen3-0.6b-shape"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--modes", default="compiled")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_decode.json"))
    args = ap.parse_args()
    from make_qwen3_06b_shape import make

    path = str(make(Path(args.model)))
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    from leverlab.models.config import ModelConfig

    cfg = ModelConfig.from_folder(path)
    bw = measure_bandwidth(args.threads)
    torch.set_num_threads(args.threads)
    bytes_per_step = cfg.weight_bytes(torch.finfo(getattr(torch, args.dtype)).bits / 8)
    roof = bw * 1e9 / bytes_per_step
    print(f"model {path}: {cfg.num_params() / 1e6:.0f}M params, {bytes_per_step / 1e9:.2f} GB of weights per step")
    print(f"memory bandwidth {bw:.1f} GB/s with {args.threads} threads -> decode roofline {roof:.1f} tok/s "
          f"(batch 1, {args.dtype})", flush=True)
    result = {"model": path, "dtype": args.dtype, "threads": args.threads, "bandwidth_gb_s": bw,
              "weight_bytes_per_step": bytes_per_step, "roofline_tok_s": roof}
    for mode in args.modes.split(","):
        result[f"leverlab_{mode}"] = bench_leverlab(path, args.dtype, args.prompt_len, args.decode_len, batches, mode)
    if not args.skip_transformers:
        result["transformers"] = bench_transformers(path, getattr(torch, args.dtype), args.prompt_len,
                                                    args.decode_len, batches)
    print("\n| engine | batch | TTFT (s) | decode tok/s | x transformers | % of roofline |")
    print("|---|---|---|---|---|---|")
    for key in [k for k in result if k.startswith(("leverlab", "transformers"))]:
        for b in batches:
            r = result[key][b]
            base = result.get("transformers", {}).get(b)
            ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
            # At batch b one step reads the weights once and yields b tokens: the roofline scales with b.
            share = 100 * r["decode_tok_s"] / (roof * b)
            print(f"| {key} | {b} | {r['ttft_s']:.2f} | {r['decode_tok_s']:.1f} | {ratio} | {share:.0f}% |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
