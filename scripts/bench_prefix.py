"""Prefix-caching benchmark (issue 8): TTFT with and without the cache on a shared-prefix workload, one run.

Every request is a ~1,000-token system prompt shared by all, then a short distinct user suffix. Requests
run one at a time so TTFT is pure prefill. Prints median TTFT for both settings, their ratio, and the
cache's own miss breakdown next to what the workload's construction predicts.

    python scripts/bench_prefix.py [--model DIR] [--requests 12] [--prefix-tokens 1000] [--suffix-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from leverlab import LLM, SamplingParams
    from leverlab.config import default_model_path
    from leverlab.core.block_manager import PrefixStats

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--suffix-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--execution-mode", default="eager")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    # Token ids from the bundled held-out prompts: real code, never trained on.
    work = json.loads((ROOT / "models" / "workload.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = "\n".join(p["text"] for p in work["buckets"]["long"]["prompts"])
    ids = tok.encode(text, add_special_tokens=False)
    prefix = ids[: args.prefix_tokens]
    suffixes = [ids[args.prefix_tokens + i * args.suffix_tokens : args.prefix_tokens + (i + 1) * args.suffix_tokens]
                for i in range(args.requests)]
    prompts = [prefix + s for s in suffixes]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    results = {}
    for caching in (False, True):
        llm = LLM(args.model, dtype=args.dtype, execution_mode=args.execution_mode, enable_prefix_caching=caching,
                  block_size=args.block_size)
        llm.generate([[1, 2, 3]], params)  # warm-up, unrelated tokens; then start the counts cold
        llm.engine.reset_prefix_cache()
        llm.engine.blocks.stats = PrefixStats()
        ttfts, outs = [], []
        for p in prompts:
            o = llm.generate([p], params)[0]
            ttfts.append(o.metrics.ttft)
            outs.append(o.outputs[0].token_ids)
        stats = llm.engine.blocks.stats
        results[caching] = (ttfts, outs, stats)
        print(f"prefix caching {'on ' if caching else 'off'}: median TTFT {1e3 * statistics.median(ttfts):7.1f} ms "
              f"(first {1e3 * ttfts[0]:.1f} ms)")
    off, on = (statistics.median(results[c][0]) for c in (False, True))
    same = results[False][1] == results[True][1]
    print(f"\nmedian TTFT ratio off/on: {off / on:.1f}x   (bar: >= 3x)   greedy outputs identical: {same}")
    s = results[True][2]
    bs = args.block_size
    n, plen = args.requests, len(prompts[0])
    full_prefix = (args.prefix_tokens // bs) * bs
    # Construction: request 1 misses everything (new). Later ones hit the shared full blocks; the block that
    # straddles the prefix/suffix boundary shares only prefix_tokens % bs tokens (a prefix < one block).
    # A suffix can also start like an earlier one by chance: those tokens are shared too (still < one block).
    chance = 0
    for i in range(1, n):
        straddle = prompts[i][full_prefix : full_prefix + bs]
        chance += max(_common(straddle, p[full_prefix : full_prefix + bs]) for p in prompts[:i]) - (
            args.prefix_tokens - full_prefix)
    expect = {"hits": (n - 1) * full_prefix, "miss_partial": (n - 1) * (args.prefix_tokens - full_prefix) + chance,
              "miss_new": plen + (n - 1) * (plen - args.prefix_tokens) - chance, "miss_evicted": 0}
    print(f"{'':14s} {'measured':>9s} {'expected':>9s}")
    for k, v in expect.items():
        print(f"{k:14s} {getattr(s, k):9d} {v:9d}")
    return 0


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
