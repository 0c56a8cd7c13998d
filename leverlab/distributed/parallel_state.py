"""Who this process is in the tensor-parallel group, and how the model's dimensions split across ranks.

A model is built under `use_tp(state)`: its layers read `current()` once, at construction, and keep the
state they saw. So one process can hold a sharded target model (TP=N) and an unsharded draft model
(speculative decoding keeps the draft at degree 1 on rank 0) side by side.

Splits (rank r of N):
  query heads      nh / N per rank, contiguous: rank r holds heads [r * nh/N, (r + 1) * nh/N)
  KV heads         nkv >= N: nkv / N per rank, contiguous; nkv < N: one per rank, replicated, rank r holding
                   the KV head its query heads read (GQA: query head h reads KV head h // (nh / nkv))
  MLP              intermediate / N columns of gate and of up (column-parallel), rows of down (row-parallel)
  MoE experts      each expert (and Qwen2-MoE's shared expert) as an MLP: moe_intermediate / N of its width per
                   rank; the router and the shared expert's gate replicated (models/moe.py)
  vocabulary       V / N rows of the embedding table and of the output head
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from leverlab.errors import UnsupportedLever


@dataclass
class TPState:
    rank: int = 0
    size: int = 1
    # torch.distributed group for the collectives inside a forward (all-reduce, logits gather): gloo on CPU,
    # NCCL on CUDA, with a short timeout (a hung peer fails the step instead of hanging it). None when size 1.
    group: Any = None
    group_id: int = 0  # key of `group` in comm.GROUPS (custom ops take ints, not process groups)


SINGLE = TPState()
_CURRENT: TPState = SINGLE


def current() -> TPState:
    return _CURRENT


@contextmanager
def use_tp(state: TPState | None) -> Iterator[None]:
    """Layers built inside read `state` (None: a single rank)."""
    global _CURRENT
    old, _CURRENT = _CURRENT, state or SINGLE
    try:
        yield
    finally:
        _CURRENT = old


def split(n: int, tp: TPState) -> tuple[int, int]:
    """(start, size) of this rank's contiguous share of n items, n divisible by tp.size (checked earlier)."""
    size = n // tp.size
    return tp.rank * size, size


def kv_heads_split(num_heads: int, num_kv_heads: int, tp: TPState) -> tuple[int, int]:
    """(first KV head, count) this rank holds: its own KV heads, or the one replicated KV head its query
    heads read when there are fewer KV heads than ranks."""
    if num_kv_heads >= tp.size:
        return split(num_kv_heads, tp)
    first_q = tp.rank * (num_heads // tp.size)
    return first_q // (num_heads // num_kv_heads), 1


def local_kv_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


def check_model(cfg, tp_size: int) -> None:
    """Refuse, with the numbers, a model whose dimensions do not split evenly over tp_size ranks."""
    if tp_size == 1:
        return
    problems = []
    if cfg.num_heads % tp_size:
        problems.append(f"num_attention_heads {cfg.num_heads} is not divisible by {tp_size}")
    nkv = cfg.num_kv_heads
    if nkv >= tp_size and nkv % tp_size:
        problems.append(f"num_key_value_heads {nkv} is not divisible by {tp_size}")
    if nkv < tp_size and tp_size % nkv:
        problems.append(f"num_key_value_heads {nkv} (replicated, fewer than the ranks) does not divide {tp_size}")
    dense_layers = not cfg.is_moe or not all(cfg.sparse_layers)  # an all-MoE model never builds intermediate_size
    if dense_layers and cfg.intermediate_size % tp_size:
        problems.append(f"intermediate_size {cfg.intermediate_size} is not divisible by {tp_size}")
    if cfg.is_moe and cfg.moe_intermediate_size % tp_size:
        problems.append(f"moe_intermediate_size {cfg.moe_intermediate_size} (each expert's width) is not divisible "
                        f"by {tp_size}")
    if cfg.shared_expert_intermediate_size % tp_size:
        problems.append(f"shared_expert_intermediate_size {cfg.shared_expert_intermediate_size} is not divisible "
                        f"by {tp_size}")
    if cfg.vocab_size % tp_size:
        problems.append(f"vocab_size {cfg.vocab_size} is not divisible by {tp_size}")
    if problems:
        raise UnsupportedLever(f"--tensor-parallel-size {tp_size} cannot split this model: " + "; ".join(problems))
