"""Quality drift of each quantization lever (issue 6): perplexity, KL divergence and greedy next-token agreement
against the unquantized model, on held-out text, through the engine itself (LLM API, prompt logprobs).

    python scripts/eval_quant_quality.py [--model DIR] [--methods int8,int8@none,int4,...]
                                         [--kv-cache-dtypes int8,fp8] [--tokens 16384] [--window 512]
                                         [--chunk 16] [--dtype bfloat16]

A method is a --quantization name, optionally with @HEAD for --lm-head-quantization (int8@none: int8 layers
with the output head left in the model dtype; plain int8/int4 put the head in int8).
KL: the mean over scored positions of KL(baseline || method), from the full distributions (the logits each
engine step returns are tapped; rows come in the same order in every run since greedy scheduling does not
depend on values).

Held-out text: the stdlib files that the bundled model family never trained on (leverlab.train.corpus's
"heldout" split), tokenized with the model's own tokenizer; windows of --window tokens, each scored from its
start (no shared prefixes, prefix caching off). Per method: perplexity over every scored position, its change
against the baseline, and the share of positions whose argmax token matches the baseline's.
--chunk sets the step's token budget: at the default 16 every step takes the fused path with the streaming
kernels, i.e. exactly the arithmetic of decode (int8/int4: per-32-block int8 activations, integer dot
products); a larger chunk (e.g. 512) measures the batched prefill kernels instead (int8's W8A8 fbgemm path,
int4's int8 copy). --weight-only-kernels turns the batched int8 x int8 paths off.
Bars (issue 6): int8 within 1% of the baseline perplexity; int4 with group 64 or finer within 5%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LEVERLAB_EXECUTION_MODE", "eager")  # numerics do not depend on the mode; compiles cost

BARS = {"int8": 1.0, "int8-woq": 1.0, "int4": 5.0, "int4-g32": 5.0, "int4-g64": 5.0}


def heldout_ids(tokenizer, n_tokens: int) -> list[int]:
    from leverlab.train.corpus import load_splits

    ids: list[int] = []
    for f in load_splits()["heldout"]:
        ids += tokenizer.encode(f.text, add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


class LogitTap:
    """Wraps the runner's execute (whose logits come from the fused C++ step or from compute_logits): keeps the
    baseline's log-probabilities of every row it returns (float16), or accumulates KL(baseline || this run) row
    by row against them."""

    def __init__(self, execute, ref: list | None = None):
        self.execute, self.ref, self.rows, self.kl_sum, self.n = execute, ref, [], 0.0, 0

    def __call__(self, batch):
        import torch

        result = self.execute(batch)
        parts = [result.logits] + [pl for _, _, pl in result.prompt_logits]
        parts = [p for p in parts if p.numel()]
        if parts:
            lp = torch.log_softmax(torch.cat(parts).float(), dim=-1)
            if self.ref is None:
                self.rows.append(lp.half())
            else:
                ref = self.ref[len(self.rows)].float()
                self.rows.append(None)
                self.kl_sum += float((ref.exp() * (ref - lp)).sum())
                self.n += lp.shape[0]
        return result


def score(model: str, dtype: str, windows: list[list[int]], chunk: int, quantization=None, kv_cache_dtype="auto",
          head="auto", ref_rows=None) -> dict:
    from leverlab import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              lm_head_quantization=head, enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=chunk,
              max_model_len=max(len(w) for w in windows) + 8)
    runner = llm.engine.runner
    tap = LogitTap(runner.execute, ref_rows)
    runner.execute = tap
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    nll, top = [], []
    for o in outs:
        for pos, lp in enumerate(o.prompt_logprobs[1:], start=1):
            nll.append(-lp[o.prompt_token_ids[pos]])
            top.append(max(lp, key=lp.get))
    return {"ppl": math.exp(sum(nll) / len(nll)), "nll": nll, "top": top, "seconds": time.perf_counter() - t0,
            "rows": tap.rows, "kl": tap.kl_sum / tap.n if tap.n else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "leverlab-code-15m"))
    ap.add_argument("--methods", default="int8,int8@none,int4,int4@none,int4-g32,int4-g128,fp8")
    ap.add_argument("--kv-cache-dtypes", default="int8,fp8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=16, help="tokens per step (16: decode arithmetic, fused path)")
    ap.add_argument("--weight-only-kernels", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "quant_quality.json"))
    args = ap.parse_args()
    if args.weight_only_kernels:
        from leverlab.quant import registry
        from leverlab.quant.int4 import Int4Method

        Int4Method.w8a8_min_rows = None
        for name, (module, cls, opts) in list(registry.QUANT_METHODS.items()):
            if name.startswith("int8"):
                registry.QUANT_METHODS[name] = (module, cls, {**opts, "w8a8_min_rows": None})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = heldout_ids(tok, args.tokens)
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window) if len(ids[i:i + args.window]) > 1]
    print(f"model {args.model}, {args.dtype}; {len(ids)} held-out tokens in {len(windows)} windows; "
          f"{args.chunk} tokens per step; batched int8 x int8 paths "
          f"{'off' if args.weight_only_kernels else 'on'}", flush=True)
    base = score(args.model, args.dtype, windows, args.chunk)
    print(f"baseline ({args.dtype}): perplexity {base['ppl']:.4f} ({base['seconds']:.0f} s)", flush=True)
    configs = [(m, "auto") for m in args.methods.split(",") if m] + \
              [(None, k) for k in args.kv_cache_dtypes.split(",") if k]
    rows = []
    for spec, kv in configs:
        method, _, head = (spec or "").partition("@")
        method, head = method or None, head or "auto"
        r = score(args.model, args.dtype, windows, args.chunk, method, kv, head, base["rows"])
        agree = sum(a == b for a, b in zip(r["top"], base["top"])) / len(base["top"])
        change = 100 * (r["ppl"] / base["ppl"] - 1)
        bar = BARS.get(method or "")
        verdict = "-" if bar is None else ("pass" if abs(change) <= bar else "FAIL")
        rows.append({"weights": spec or args.dtype, "kv_cache_dtype": kv, "ppl": r["ppl"], "ppl_change_pct": change,
                     "kl": r["kl"], "top1_agreement": agree, "bar_pct": bar, "verdict": verdict})
        print(f"  {spec or args.dtype} / kv {kv}: perplexity {r['ppl']:.4f} ({change:+.2f}%), KL {r['kl']:.5f}, "
              f"top-1 agreement {100 * agree:.1f}%  [{verdict}] ({r['seconds']:.0f} s)", flush=True)
    print("\n| weights (@head) | KV cache | perplexity | change | KL(base || q) | greedy next-token agreement | bar |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.dtype} | auto | {base['ppl']:.3f} | - | - | - | - |")
    for r in rows:
        bar = f"<= {r['bar_pct']:.0f}%: {r['verdict']}" if r["bar_pct"] is not None else "-"
        print(f"| {r['weights']} | {r['kv_cache_dtype']} | {r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}% | "
              f"{r['kl']:.5f} | {100 * r['top1_agreement']:.1f}% | {bar} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "tokens": len(ids),
                                          "weight_only_kernels": args.weight_only_kernels, "chunk": args.chunk,
                                          "baseline_ppl": base["ppl"], "rows": rows}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
