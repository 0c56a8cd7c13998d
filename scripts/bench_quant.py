"""Quantization benchmark (issue 6): decode speed of each weight precision on the Qwen3-0.6B-shaped checkpoint,
beside the bytes it reads and its roofline, in one run.

For each precision (bf16, then --quantization int8 / int4 / ...): single-stream decode tok/s and aggregate
decode tok/s at batch 16 through the engine (default: the compiled fast path), the weight bytes one decode
step reads (measured from the loaded model's tensors: the kernel layouts, scales included; the tied output
head counted once; of a mixture of experts, the routed experts the engine counted its decode steps reading), the KV
bytes it reads, and the roofline = memory bandwidth / bytes per step. Ratios
against bf16 in the same run are what to compare; these machines are shared and noisy.
Reference on this machine class (anchors): llama.cpp decodes 27.3 tok/s in bf16, 43.6 in Q8_0, 65.0 in Q4_0.
Bars: int8 >= 1.4x bf16 single-stream, int4 >= 1.8x, neither slower than bf16 at batch 16.

    python scripts/bench_quant.py [--methods bf16,int8,int4] [--mode compiled] [--kv-cache-dtypes auto,int8]
                                  [--prompt-len 128] [--decode-len 128] [--batch 16] [--threads N]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

BARS_B1 = {"int8": 1.4, "int4": 1.8}


def step_weight_bytes(model, rows: int, hit_experts: float | None = None) -> int:
    """Bytes of weights one forward of `rows` rows reads: every Linear in the layout its path uses, plus norms.
    The embedding lookup reads `rows` rows only (negligible); a tied head is the embedding, counted once.
    Of a mixture of experts, the routed experts the step reads: `hit_experts` per sparse layer (measured: the
    engine's counters, hit_experts_per_layer), by default num_experts_per_tok, one sequence's read; plus the
    routers (models/expert_reads.py counts the same way in the engine)."""
    from leverlab.layers.linear import Linear
    from leverlab.models.expert_reads import expert_bytes
    from leverlab.models.moe import Router, SparseMoE

    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    routed = {id(e) for moe in moes for e in moe.experts.modules()}
    total = 0
    for m in model.modules():
        if id(m) in routed:
            continue
        if isinstance(m, Linear):
            if m.quant_method is not None:
                total += m.quant_method.bytes_read(m, rows)
            else:
                total += sum(p.numel() * p.element_size() for p in m.parameters())
        elif type(m).__name__ == "RMSNorm" or isinstance(m, Router | torch.nn.Linear):  # (a shared expert's gate)
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    for moe in moes:
        total += round((moe.gate.top_k if hit_experts is None else hit_experts) * expert_bytes(moe))
    return total


def expert_counts(runner) -> tuple[int, int] | None:
    """The engine's counts so far of a mixture of experts' decode passes and the experts they read (None: dense)."""
    reads = runner.expert_reads
    return None if reads is None else (reads.passes, reads.experts)


def hit_experts_per_layer(runner, before: tuple[int, int] | None) -> float | None:
    """The distinct routed experts each sparse layer read per decode pass since expert_counts() gave `before`, as
    the engine counted them from its router (models/expert_reads.py); None for a dense model or no decode pass."""
    reads = runner.expert_reads
    if reads is None or before is None or reads.passes == before[0]:
        return None
    return (reads.experts - before[1]) / (reads.passes - before[0]) / len(reads.per_expert)


def run(path: str, method: str, mode: str, kv: str, prompt_len: int, decode_len: int, batch: int) -> dict:
    from leverlab import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", quantization=None if method == "bf16" else method, kv_cache_dtype=kv,
              execution_mode=mode, max_num_seqs=batch, max_num_batched_tokens=max(512, prompt_len),
              max_model_len=prompt_len + decode_len + 16, enable_prefix_caching=False)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[7] * prompt_len] * batch, warm)
    llm.generate([[7] * prompt_len], warm)
    res = {"setup_s": time.perf_counter() - t0}
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for b in (1, batch):
        hi = min(1000, runner.model_config.vocab_size)  # a small random checkpoint's vocabulary (the MoE shapes')
        prompts = [torch.randint(hi // 10, hi, (prompt_len,), generator=g).tolist() for _ in range(b)]
        before = expert_counts(runner)
        outs = llm.generate(prompts, params)
        hit = hit_experts_per_layer(runner, before)
        start = max(o.metrics.first_token_time for o in outs)
        end = max(o.metrics.last_token_time for o in outs)
        decoded = sum(1 for o in outs for t in o.metrics.token_times if t > start)
        # bytes per decode step: the weights once, plus every sequence's KV context (mean over the decode)
        ctx = prompt_len + decode_len / 2
        res[b] = {"decode_tok_s": decoded / max(1e-9, end - start),
                  "weight_bytes_step": step_weight_bytes(runner.model, b, hit),
                  "hit_experts_per_layer": hit,
                  "kv_bytes_step": int(b * ctx * runner.kv_bytes_per_token())}
        print(f"  {method} ({mode}) batch {b:2d}: decode {res[b]['decode_tok_s']:.1f} tok/s "
              f"(setup {res['setup_s']:.0f} s)", flush=True)
    del llm, runner
    gc.collect()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "qwen3-0.6b-shape"))
    ap.add_argument("--methods", default="bf16,int8,int4")
    ap.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--kv-cache-dtypes", default="auto", help="e.g. auto,int8: every method with each, one run")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_quant.json"))
    args = ap.parse_args()
    from make_qwen3_06b_shape import make

    from leverlab.study.bandwidth import measure_bandwidth

    path = str(make(Path(args.model)))
    bw = measure_bandwidth(args.threads)
    torch.set_num_threads(args.threads)
    print(f"model {path}; memory bandwidth {bw:.1f} GB/s with {args.threads} threads; mode {args.mode}; "
          f"KV cache {args.kv_cache_dtypes}", flush=True)
    result = {"model": path, "threads": args.threads, "bandwidth_gb_s": bw, "mode": args.mode,
              "kv_cache_dtypes": args.kv_cache_dtypes, "runs": {}}
    for kv in args.kv_cache_dtypes.split(","):
        for m in args.methods.split(","):
            key = m if kv == "auto" else f"{m} kv={kv}"
            result["runs"][key] = run(path, m, args.mode, kv, args.prompt_len, args.decode_len, args.batch)
    runs, b = result["runs"], args.batch
    base = runs.get("bf16")
    print("\n| precision | batch | weight MB / step | KV MB / step | roofline tok/s | measured tok/s | "
          "% of roofline | x bf16 | bar |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, r in runs.items():
        for bb in (1, b):
            x = r[bb]
            step = x["weight_bytes_step"] + x["kv_bytes_step"]
            roof = bw * 1e9 / step * bb  # one step reads the weights once and yields bb tokens
            ratio = x["decode_tok_s"] / base[bb]["decode_tok_s"] if base else float("nan")
            x["roofline_tok_s"], x["x_bf16"] = roof, ratio
            if m == "bf16" or " kv=" in m:
                bar = "-"
            elif bb == 1 and m.split("-")[0].split("+")[0] in BARS_B1:
                need = BARS_B1[m.split("-")[0].split("+")[0]]
                bar = f">= {need}x: {'pass' if ratio >= need else 'FAIL'}"
            else:
                bar = f">= 1.0x: {'pass' if ratio >= 1.0 else 'FAIL'}" if bb > 1 else "-"
            print(f"| {m} | {bb} | {x['weight_bytes_step'] / 1e6:.0f} | {x['kv_bytes_step'] / 1e6:.0f} | "
                  f"{roof:.1f} | {x['decode_tok_s']:.1f} | {100 * x['decode_tok_s'] / roof:.0f}% | {ratio:.2f}x | {bar} |")
    print("\nllama.cpp on this machine class (anchors, batch 1): bf16 27.3, Q8_0 43.6, Q4_0 65.0 tok/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
