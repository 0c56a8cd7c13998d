"""Memory read bandwidth, measured: the denominator of every bandwidth-model prediction.

Shared by `leverlab study` (predict.py) and scripts/bench_decode.py.
"""

from __future__ import annotations

import time


def measure_bandwidth(threads: int | None = None, gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in GB/s: the best of a few full passes summing a tensor far larger than the caches."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9
