"""Speculative-decoding benchmark (issue 7): speedup per method against no speculation, over concurrency.

One process, one model, the bundled code workload. For each concurrency c, c prompts run at once and the
aggregate decode rate is measured for every method in turn (interleaved, so drift on a shared machine
hits all methods alike). Prints the speedup over no speculation: best repeat over best repeat, and the median
over repeats of each repeat's ratio (paired: the methods of one repeat ran seconds apart; one lucky or unlucky
repeat of either side moves the first figure, not the second).

Python's cyclic garbage collector runs before each timed generation: the engines share one process, and a
collection triggered by one engine's garbage had landed in the next engine's timed run (an adaptive EAGLE
engine with its gate held shut, timed right after the fixed-K EAGLE engine, read 0.93x of no speculation at
c=8; collecting first, or timing it after the plain engine instead, 1.00x).

    python scripts/bench_spec.py [--model DIR] [--concurrency 1,2,4,8,16] [--max-tokens 128] [--k 4]
                                 [--eagle HEAD_DIR [--eagle-k 3]] [--threads 1]

EAGLE runs when --eagle is given, or when models/leverlab-code-eagle exists (the bundled model's head).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from leverlab import LLM, SamplingParams
    from leverlab.config import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--execution-mode", default="eager")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eagle", default=None, help="EAGLE head folder (default: models/leverlab-code-eagle if present)")
    ap.add_argument("--eagle-k", type=int, default=None, help="drafts per step for eagle (default: --k)")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's choice)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_spec.json"))
    args = ap.parse_args()

    work = json.loads((ROOT / "models" / "workload.json").read_text())
    texts = [p["text"] for p in work["buckets"]["decode"]["prompts"]]
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    methods = {"none": None, f"ngram k={args.k}": ngram, "ngram adaptive": {**ngram, "adaptive": True}}
    eagle = args.eagle or (str(ROOT / "models" / "leverlab-code-eagle")
                           if (ROOT / "models" / "leverlab-code-eagle" / "config.json").exists() else None)
    if eagle:
        ek = args.eagle_k or args.k
        methods[f"eagle k={ek}"] = {"method": "eagle", "model": eagle, "num_speculative_tokens": ek}
        methods["eagle adaptive"] = {**methods[f"eagle k={ek}"], "adaptive": True}
    engines = {name: LLM(args.model, dtype=args.dtype, execution_mode=args.execution_mode, speculative_config=sc,
                         max_num_seqs=64, num_threads=args.threads) for name, sc in methods.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(texts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    levels = [int(c) for c in args.concurrency.split(",")]
    rates: dict[str, dict[int, float]] = {m: {} for m in methods}  # best repeat
    paired: dict[str, dict[int, float]] = {m: {} for m in methods}  # median of per-repeat ratios to "none"
    outputs: dict[str, list] = {}
    for c in levels:
        prompts = [texts[i % len(texts)] for i in range(c)]
        runs: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                gc.collect()  # each timed run pays for its own garbage, not the previous engine's
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                runs[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
                outputs.setdefault(name, []).append([o.outputs[0].token_ids for o in outs])
        for name in methods:
            rates[name][c] = max(runs[name])  # best of repeats: least disturbed
            paired[name][c] = statistics.median(a / b for a, b in zip(runs[name], runs["none"]))
        print(f"c={c:2d}  " + "  ".join(f"{n}: {rates[n][c]:7.1f} tok/s" for n in methods), flush=True)
    print("\nspeedup over no speculation: best repeat / best repeat (median of the per-repeat ratios)")
    print("| method | " + " | ".join(f"c={c}" for c in levels) + " | acceptance |")
    print("|---|" + "---|" * (len(levels) + 1))
    for name, llm in engines.items():
        cnt = llm.engine.counter_snapshot()
        acc = (f"{cnt['spec_accepted_tokens'] / max(1, cnt['spec_draft_tokens']):.0%} of "
               f"{cnt['spec_draft_tokens']} drafts" if "spec_draft_tokens" in cnt else "-")
        cells = [f"{rates[name][c] / rates['none'][c]:.2f}x ({paired[name][c]:.2f})" for c in levels]
        print(f"| {name} | " + " | ".join(cells) + f" | {acc} |")
    lossless = all(outputs[n] == outputs["none"] for n in methods)
    for name in methods:
        pairs = [(a, b) for ra, rb in zip(outputs[name], outputs["none"]) for a, b in zip(ra, rb)]
        same = sum(a == b for a, b in pairs)
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs if a != b]
        where = f", first divergence at token {sum(firsts) / len(firsts):.0f} on average" if firsts else ""
        print(f"{name}: {same}/{len(pairs)} outputs identical to no speculation{where}")
    print(f"greedy outputs identical to no speculation: {lossless}"
          + ("" if lossless or args.dtype == "float32" else
             f" ({args.dtype}: verifying K+1 tokens in one pass changes matmul shapes and so rounding; "
             "in float32 the tests require identity)"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rates": rates, "paired_ratios": paired, "lossless": lossless,
                                          "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
