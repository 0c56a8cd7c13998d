"""Memory read bandwidth, measured: the denominator of every bandwidth-model prediction.

Shared by `leverlab study` (predict.py) and scripts/bench_decode.py.
"""

from __future__ import annotations

import time


def _best_time(fn, reps: int) -> float:
    """The fastest of `reps` timed calls of fn, after one untimed call (first-touch, warm-up)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(threads: int | None = None, gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in GB/s: the best of a few full passes summing a tensor far larger than the caches, in
    torch's own (4 KB-page) memory and in huge-page memory, where the engine keeps CPU weights
    (kernels/huge_pages.py). Read through 4 KB pages alone, a roofline sat below what the engine's kernels reach:
    the bf16 0.6B shape decoded at 103% of it (huge pages read 3-7% faster here)."""
    import torch

    from leverlab.kernels.huge_pages import huge_page_buffer

    if threads:
        torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4

    x = torch.ones(n, dtype=torch.float32)
    best = _best_time(x.sum, reps)
    del x  # freed before the next: the peak stays at one buffer
    huge = huge_page_buffer(n * 4)
    if huge is not None:
        best = min(best, _best_time(huge.view(torch.float32).fill_(1.0).sum, reps))
    return n * 4 / best / 1e9


def thread_scaling(threads: int, n: int = 512, reps: int = 5) -> float | None:
    """How many times faster `threads` threads run a compute-bound float32 product (n x n by n x n, from cache)
    than one thread: near `threads` where the host runs them on separate cores, near 1 where it runs them on one
    core's two hyperthreads or time-slices them. None for one thread. Why: the steal counter (study/steal.py) does
    not see the second case, and on this project's shared VMs two vCPUs at times delivered one core's arithmetic
    between them (docs/quantization.md: the machine's steal time), which moves every compute-bound figure."""
    import torch

    if threads <= 1:
        return None
    a, b = torch.randn(n, n), torch.randn(n, n)

    def best(k: int) -> float:
        torch.set_num_threads(k)
        return _best_time(lambda: torch.mm(a, b), reps)

    one = best(1)
    many = best(threads)  # leaves torch at `threads`
    return one / many
