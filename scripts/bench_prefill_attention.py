"""Fresh-prompt (prefill) attention: our AMX kernel against PyTorch's CPU flash attention, the same bf16 tensors.

Causal self-attention of an n-token prompt with no cached prefix, as the engine runs it for a cold prompt
(kernels' amx_fresh_attention, called from paged_decode). Prints each shape's best-of-N time for both, in
alternating rounds of one process, their ratio, and each one's rate in useful multiply-adds a second (the causal
half of 2 n^2 D H). Needs a CPU with AMX-BF16 (Sapphire Rapids or later); elsewhere it says so and stops.

    python scripts/bench_prefill_attention.py [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from leverlab.kernels.cpu_kernels import kernels  # noqa: E402

SHAPES = [  # (name, n, query heads, KV heads, head size)
    ("Qwen3-0.6B shape, 1,024 tokens", 1024, 16, 8, 128),
    ("Qwen3-0.6B shape, 333 tokens", 333, 16, 8, 128),
    ("bundled model, 1,500 tokens", 1500, 6, 2, 64),
    ("bundled model, 512 tokens", 512, 6, 2, 64),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = kernels()
    if kern is None or not kern.amx_attention_takes(64):
        sys.exit("no AMX-BF16 here (or the C++ kernels are off): fresh prompts take PyTorch's flash attention")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"{args.threads} thread(s), best of {args.reps}, rounds alternating")
    for name, n, h, kvh, d in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(n, h, d, generator=g).bfloat16()
        k, v = (torch.randn(n, kvh, d, generator=g).bfloat16() for _ in range(2))
        out = torch.empty_like(q)
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
        paths = {"ours": lambda q=q, k=k, v=v, out=out, d=d: kern.amx_fresh_attention(q, k, v, out, d**-0.5),
                 "flash": lambda qb=qb, kb=kb, vb=vb, d=d: sdpa(qb, kb, vb, is_causal=True, scale=d**-0.5,
                                                                enable_gqa=True)}
        best = dict.fromkeys(paths, float("inf"))
        for f in paths.values():
            f()
        for _ in range(args.reps):
            for key, f in paths.items():
                t0 = time.perf_counter()
                f()
                best[key] = min(best[key], time.perf_counter() - t0)
        macs = n * n * d * h  # the causal half of 2 n^2 D H
        print(f"{name:34s} ours {best['ours'] * 1e3:7.2f} ms ({macs / best['ours'] / 1e9:4.0f} G/s)   "
              f"flash {best['flash'] * 1e3:7.2f} ms ({macs / best['flash'] / 1e9:4.0f} G/s)   "
              f"ours / flash speed {best['flash'] / best['ours']:.2f}x")


if __name__ == "__main__":
    main()
