"""Kernel comparison for the quantization levers (issue 6): one MLP-shaped block stack, eager and compiled.

A stack of `--layers` Qwen3-0.6B MLPs (gate_up 6144x1024, down 1024x3072; distinct weights, so they stream
from memory as in a real decode step, not from L3) runs with each precision's Linear, at 1 and 16 rows:
  bf16 F.linear | int8 (fbgemm int8 x int8, the default) | int8-woq (`_weight_int8pack_mm` below 9 rows)
  | int8-mm (`mm(x, q.t().to(bf16)) * s`, Inductor's weight-only-int8 pattern) | int4 (`_weight_int4pack_mm_for_cpu`,
  int8 copy from 9 rows) | fp8 storage (converted in the matmul)
each eager and under torch.compile (Inductor freezing + max-autotune, CPP GEMM templates), the engine's fast
path. Prints microseconds per layer and GB/s of weight bytes. Ratios within one run are what to compare.

    python scripts/bench_quant_kernels.py [--layers 8] [--rows 1,16] [--variants ...] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from leverlab.layers.linear import Linear  # noqa: E402
from leverlab.models.loader import attach_quant_method, finish_quantization  # noqa: E402
from leverlab.quant.base import QuantMethod  # noqa: E402
from leverlab.quant.registry import get_quant_method  # noqa: E402

H, INTER = 1024, 3072


class MMInt8(QuantMethod):
    """int8 written as the mm-with-conversion pattern Inductor's weight-only-int8 rewrite matches."""

    def apply(self, layer, x):
        return torch.mm(x, layer.qweight.t().to(x.dtype)) * layer.scales


class Stack(nn.Module):
    def __init__(self, n: int, method: str | None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ups = nn.ModuleList(Linear(H, 2 * INTER) for _ in range(n))
        self.downs = nn.ModuleList(Linear(INTER, H) for _ in range(n))
        for m in [*self.ups, *self.downs]:
            m.weight.data = (torch.randn(m.out_features, m.in_features, generator=g) * 0.02).to(torch.bfloat16)
        qname = "int8-woq" if method == "int8-mm" else method  # int8-woq keeps the plain int8 weight
        if qname:
            finish_quantization(attach_quant_method(self, get_quant_method(qname)))
        if method == "int8-mm":
            mm = MMInt8()
            for m in [*self.ups, *self.downs]:
                m.use(mm)

    def forward(self, x):
        for up, down in zip(self.ups, self.downs):
            gate, u = up(x).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * u)
        return x


def weight_bytes(model: nn.Module, rows: int) -> int:
    """Bytes the stack's matmuls read at `rows` rows (packed int8 weights are not parameters)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            qm = m.quant_method
            total += qm.bytes_read(m, rows) if hasattr(qm, "bytes_read") else sum(
                p.numel() * p.element_size() for p in m.parameters())
    return total


def timeit(fn, x, reps: int) -> float:
    with torch.inference_mode():
        for _ in range(2):
            fn(x)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--variants", default="bf16,int8,int8-woq,int8-mm,int4,fp8")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    import torch._inductor.config as ic

    ic.freezing = True
    ic.cpp.weight_prepack = True
    ic.max_autotune_gemm_backends = "CPP,ATEN"
    print(f"{args.layers} MLP blocks (gate_up {2 * INTER}x{H} + down {H}x{INTER}), threads {torch.get_num_threads()}")
    print("| variant | mode | rows | us / block | GB/s of weights | x bf16 same mode |")
    print("|---|---|---|---|---|---|")
    base: dict = {}
    for v in args.variants.split(","):
        model = Stack(args.layers, None if v == "bf16" else v).eval()
        modes = [("eager", model.forward)]
        if not args.no_compile:
            torch._dynamo.reset()
            modes.append(("compiled", torch.compile(model.forward, dynamic=True, mode="max-autotune-no-cudagraphs")))
        for mode, fn in modes:
            for r in rows:
                x = torch.randn(r, H, dtype=torch.bfloat16)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    fn(x)
                first = time.perf_counter() - t0
                t = timeit(fn, x, args.reps)
                per = t / args.layers * 1e6
                base.setdefault((mode, r), per) if v == "bf16" else None
                ratio = base.get((mode, r), per) / per
                print(f"| {v} | {mode} | {r} | {per:.0f} | {weight_bytes(model, r) / t / 1e9:.1f} | {ratio:.2f}x |"
                      f"{f'  (first call {first:.0f} s)' if first > 5 else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
