"""Memory read bandwidth, measured: the denominator of every bandwidth-model prediction.

Shared by `leverlab study` (predict.py) and scripts/bench_decode.py.
"""

from __future__ import annotations

import time


def measure_bandwidth(threads: int | None = None, gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in GB/s: the best of a few full passes summing a tensor far larger than the caches, in
    torch's own (4 KB-page) memory and in huge-page memory, where the engine keeps CPU weights
    (layers/huge_pages.py). Read through 4 KB pages alone, a roofline sat below what the engine's kernels reach:
    the bf16 0.6B shape decoded at 103% of it (session 12; huge pages read 3-7% faster here)."""
    import torch

    from leverlab.layers.huge_pages import huge_page_buffer

    if threads:
        torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4

    def best_pass(x) -> float:
        x.sum()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return best

    best = best_pass(torch.ones(n, dtype=torch.float32))  # freed before the next: the peak stays at one buffer
    huge = huge_page_buffer(n * 4)
    if huge is not None:
        best = min(best, best_pass(huge.view(torch.float32).fill_(1.0)))
    return n * 4 / best / 1e9
