"""bf16 linear at decode batch sizes: our AVX-512 BF16 kernel against aten, as a share of read bandwidth.

Every weight matrix of a Qwen3-0.6B-shaped stack (28 layers: qkv, o, gate_up, down; ~0.9 GB, far beyond the
caches) is multiplied once per pass, as in a decode step, for 1..8 activation rows. Kernel and aten passes
alternate and the best of --rounds counts, so a noisy spell on a shared machine hits both alike.
This is the measurement behind leverlab/layers/bf16_linear.py's MAX_ROWS.

    python scripts/bench_linear.py [--threads 2] [--rows 1,2,4,8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch
    import torch.nn.functional as F

    from leverlab.kernels import cpu_kernels
    from leverlab.study.bandwidth import measure_bandwidth

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels.kernels()
    if kern is None or not kern.has_skinny_linear():
        print("the AVX-512 BF16 kernel is not available on this machine: nothing to compare")
        return 1
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * args.layers  # [out, in] per matrix
    ws = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in shapes]
    gb = sum(w.numel() for w in ws) * 2 / 1e9
    bw = measure_bandwidth(args.threads)
    print(f"{args.threads} thread(s); {len(ws)} matrices, {gb:.2f} GB per pass; read bandwidth {bw:.1f} GB/s")
    print("| rows | kernel GB/s | aten GB/s | kernel / aten | kernel share of bandwidth |")
    print("|---|---|---|---|---|")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in shapes}}
        best = {"kernel": float("inf"), "aten": float("inf")}
        for _ in range(args.rounds):
            for name in best:
                t0 = time.perf_counter()
                for w in ws:
                    x = xs[w.shape[1]]
                    kern.skinny_linear(x, w, None) if name == "kernel" else F.linear(x, w)
                best[name] = min(best[name], time.perf_counter() - t0)
        k, a = gb / best["kernel"], gb / best["aten"]
        print(f"| {m} | {k:.1f} | {a:.1f} | {k / a:.2f}x | {k / bw:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
