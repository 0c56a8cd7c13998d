"""The grammar masks' kernels (kernels/csrc/grammar_mask.cpp) against the PyTorch path they replaced, in one run.

16 rows of random float32 logits and random bitmasks (about half the tokens allowed), at the bundled model's
8,192 tokens and a Qwen's 151,936, one thread, best of 5 interleaved rounds of 20 calls each:
  argmax  greedy tokens under the masks: bool rows unpacked + masked_fill + argmax, against bitmask_argmax
  mask    the masks applied in place (sampled rows, logprobs): unpack + masked_fill_, against apply_bitmask_

    python scripts/bench_grammar_mask.py
"""

from __future__ import annotations

import time

import torch

from leverlab.kernels import cpu_kernels
from leverlab.structured.state import unpack

ROWS = 16


def measure(kern, vocab: int, gen: torch.Generator) -> dict[str, float]:
    """Best microseconds per call of each of the four, at this vocabulary."""
    bits = torch.randint(-2**31, 2**31 - 1, (ROWS, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(ROWS, vocab, generator=gen)
    rows = torch.arange(ROWS)

    def torch_argmax():
        return logits.masked_fill(~unpack(bits)[:, :vocab], float("-inf")).argmax(dim=-1)

    def kernel_argmax():
        return kern.bitmask_argmax(logits, rows, bits)

    def torch_mask():
        x = logits.clone()
        return x.masked_fill_(~unpack(bits)[:, :vocab], float("-inf"))

    def kernel_mask():
        x = logits.clone()
        kern.apply_bitmask_(x, rows, bits)
        return x

    assert torch.equal(torch_argmax(), kernel_argmax()) and torch.equal(torch_mask(), kernel_mask())
    best: dict[str, float] = {}
    for _ in range(5):
        for f in (torch_argmax, kernel_argmax, torch_mask, kernel_mask):
            t = time.perf_counter()
            for _ in range(20):
                f()
            us = (time.perf_counter() - t) / 20 * 1e6
            best[f.__name__] = min(best.get(f.__name__, us), us)
    return best


def main() -> None:
    kern = cpu_kernels.kernels()
    if kern is None:
        raise SystemExit("the C++ kernels are not built here (python -m leverlab.kernels.cpu_kernels)")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{'vocab':>7} {'argmax torch us':>16} {'kernel us':>10} {'ratio':>6} {'mask torch us':>14} "
          f"{'kernel us':>10} {'ratio':>6}")
    for vocab in (8192, 151936):
        best = measure(kern, vocab, gen)
        a, ka, m, km = (best[n] for n in ("torch_argmax", "kernel_argmax", "torch_mask", "kernel_mask"))
        print(f"{vocab:>7} {a:>16.0f} {ka:>10.0f} {a / ka:>5.1f}x {m:>14.0f} {km:>10.0f} {m / km:>5.1f}x")


if __name__ == "__main__":
    main()
