"""The collectives a sharded model calls, and the time they take (exported as engine counters).

The all-reduce is a torch custom op, like paged attention: under `--execution-mode compiled` Inductor
compiles the matmuls around it and calls it as one opaque eager op (the process group is looked up by an
int id: custom ops take tensors and scalars only). Being opaque costs one copy of the reduced activation
(an op may not return its input), and buys a simple timer around each call, the same in both modes.

Times are host wall times on rank 0, the rank whose numbers reach /metrics. An all-reduce's time includes
waiting for the slowest rank to arrive, so it measures communication plus load imbalance: what TP pays.
On CUDA a host timer would only see the launch, so CUDA events are recorded and read at the step's end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from leverlab.distributed.parallel_state import TPState
from leverlab.kernels.custom_op import custom_op

GROUPS: dict[int, object] = {}  # group id -> torch.distributed process group (the compute group)


@dataclass
class CommStats:
    allreduce_seconds: float = 0.0
    allreduces: int = 0
    gather_seconds: float = 0.0
    _cuda_events: list = field(default_factory=list)  # (start, end) events not yet read

    def reset(self) -> None:
        self.settle()
        self.allreduce_seconds, self.allreduces, self.gather_seconds = 0.0, 0, 0.0

    def settle(self) -> None:
        """Fold pending CUDA event timings in (after the step synchronized the device)."""
        for start, end in self._cuda_events:
            self.allreduce_seconds += start.elapsed_time(end) / 1e3
        self._cuda_events.clear()


STATS = CommStats()


@custom_op("leverlab::tp_all_reduce")
def tp_all_reduce(x: torch.Tensor, group_id: int) -> torch.Tensor:
    """Sum of x over the ranks of group `group_id` (every rank gets it)."""
    out = x.contiguous().clone()
    group = GROUPS[group_id]
    STATS.allreduces += 1
    if out.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(out, group=group)
        end.record()
        STATS._cuda_events.append((start, end))
    else:
        t0 = time.perf_counter()
        dist.all_reduce(out, group=group)
        STATS.allreduce_seconds += time.perf_counter() - t0
    return out


@tp_all_reduce.register_fake
def _(x, group_id):
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor, tp: TPState) -> torch.Tensor:
    return x if tp.size == 1 else tp_all_reduce(x, tp.group_id)


def gather_vocab(local: torch.Tensor, tp: TPState) -> torch.Tensor:
    """[N, V/tp] logits of this rank's vocabulary slice -> [N, V] on rank 0 (only rank 0 samples); the
    other ranks get their own slice back, unused. A gather, not an all-gather: half the bytes."""
    if tp.size == 1:
        return local
    local = local.contiguous()
    t0 = time.perf_counter()
    parts = [torch.empty_like(local) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(local, parts, dst=0, group=GROUPS[tp.group_id])
    STATS.gather_seconds += time.perf_counter() - t0
    return torch.cat(parts, dim=-1) if tp.rank == 0 else local
