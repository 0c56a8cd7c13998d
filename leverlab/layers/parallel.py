"""Tensor-parallel layers: each rank holds a slice of a weight, cut at load time from the plain checkpoint.

  ColumnParallelLinear  output features split (fused QKV, fused gate/up, the output head): y_r = x W_r^T,
                        no communication; each checkpoint part (q, k, v, gate, up) is cut on its own.
  RowParallelLinear     input features split (o_proj, down_proj): y = sum_r x_r W_r^T, one all-reduce;
                        a bias is added once (rank 0 keeps it, the others hold zeros). With reduce=False it
                        returns this rank's partial sum and its caller reduces (an MoE layer: its experts' and
                        shared expert's partials, summed by one all-reduce per layer, models/moe.py).
  VocabParallelEmbedding  rows of the table split: ids outside a rank's range look up zeros, one all-reduce.
  ParallelLMHead        vocabulary rows split; the logits slices are gathered on rank 0, which samples.

At size 1 each is exactly the plain layer (same parameters and names, no communication).

Quantized layers shard too: the slicing happens before the quantization method sees a tensor, so methods
that quantize at load time (int8, int4, fp8) quantize each rank's slice (int8's per-row scales of a row-parallel
layer from the whole row, recorded before the cut: whole_row_absmax); pre-quantized tensors (AWQ, GPTQ,
`leverlab quantize` int8) are cut along their packed dimensions, described by the method's tensor_layout().
A slice that does not fall on a packing or group boundary is refused with the numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from leverlab.distributed import comm
from leverlab.distributed.parallel_state import TPState, current, kv_heads_split, split
from leverlab.errors import UnsupportedLever
from leverlab.layers import bf16_linear
from leverlab.layers.linear import Linear, packed
from leverlab.quant.base import DEFAULT_LAYOUTS


def _narrow(tensor: torch.Tensor, dim: int, start: int, size: int, pack: int, what: str, tp: TPState) -> torch.Tensor:
    """Features [start, start + size) of a tensor that stores `pack` features per element along `dim`."""
    if start % pack or size % pack:
        raise UnsupportedLever(
            f"--tensor-parallel-size {tp.size}: {what}: rank {tp.rank}'s features [{start}, {start + size}) do not "
            f"fall on the {pack}-feature boundaries of the packed checkpoint tensor {tuple(tensor.shape)} (a "
            "quantization group or a packed int32); use a smaller tensor-parallel size or another checkpoint")
    return tensor.narrow(dim, start // pack, size // pack)


class _ParallelLinear(Linear):
    """A Linear that cuts checkpoint tensors to this rank's slice before loading them.
    out_slices: checkpoint part (None for an unpacked layer) -> (start, size) of its output features here.
    in_slice: (start, size) of the input features here (row-parallel), or None (all of them)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shards: dict | None, tp: TPState,
                 out_slices: dict | None, in_slice: tuple[int, int] | None):
        super().__init__(in_features, out_features, bias=bias, shards=shards)
        self.tp, self.out_slices, self.in_slice = tp, out_slices, in_slice

    def shard_tensor(self, kind: str, tensor: torch.Tensor, shard: str | None) -> torch.Tensor:
        if self.tp.size == 1:
            return tensor
        method = self.quant_method
        layout = method.tensor_layout(kind) if method is not None else DEFAULT_LAYOUTS.get(kind)
        what = f"{kind}{'/' + shard if shard else ''}"
        if layout is None:
            raise UnsupportedLever(f"--tensor-parallel-size {self.tp.size}: no known way to split checkpoint "
                                   f"tensor {what!r} of {type(method).__name__ if method else 'a float layer'}")
        if self.out_slices is not None and layout.out_dim is not None:
            start, size = self.out_slices[shard]
            tensor = _narrow(tensor, layout.out_dim, start, size, layout.out_pack, what, self.tp)
        if self.in_slice is not None:
            if kind == "bias" and self.tp.rank != 0:
                return torch.zeros_like(tensor)  # the all-reduce adds rank 0's bias once
            if kind == "weight" and getattr(method, "whole_row_scales", False) and tensor.is_floating_point():
                # A per-row scale from the whole row, as TP=1 computes it (int8): each rank's slice then holds
                # TP=1's quantized weights exactly, rather than scales of its half rows.
                self.whole_row_absmax = tensor.to(self.weight.dtype).float().abs().amax(dim=1)
            if layout.in_dim is not None:
                start, size = self.in_slice
                tensor = _narrow(tensor, layout.in_dim, start, size, layout.in_pack, what, self.tp)
                if kind == "g_idx":  # GPTQ: group numbers, which restart at this rank's first group
                    tensor = _local_groups(tensor, start, size, method.group_size, what, self.tp)
        return tensor


def _local_groups(g_idx: torch.Tensor, start: int, size: int, group: int, what: str, tp: TPState) -> torch.Tensor:
    first, n = start // group, size // group
    local = g_idx.to(torch.int64) - first
    if local.numel() and (int(local.min()) < 0 or int(local.max()) >= n):
        raise UnsupportedLever(f"--tensor-parallel-size {tp.size}: {what}: this GPTQ checkpoint orders input "
                               "channels by activation (desc_act), so a rank's input slice holds channels of other "
                               "ranks' groups; it cannot be split row-wise: use TP=1 or a desc_act=false checkpoint")
    return local


class ColumnParallelLinear(_ParallelLinear):
    """parts: checkpoint part name -> (its output features in the checkpoint, start of this rank's share,
    size of this rank's share); a single unnamed part for an unpacked layer: {None: (...)}."""

    def __init__(self, in_features: int, parts: dict[str | None, tuple[int, int, int]], bias: bool = False):
        tp = current()
        if list(parts) == [None]:
            rows, shards = parts[None][2], None
        else:
            rows, shards = packed({name: local for name, (_, _, local) in parts.items()})
        out_slices = {name: (start, local) for name, (_, start, local) in parts.items()}
        super().__init__(in_features, rows, bias, shards, tp, out_slices, None)


class RowParallelLinear(_ParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True):
        tp = current()
        start, size = split(in_features, tp)
        super().__init__(size, out_features, bias, None, tp, None, (start, size))
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return comm.all_reduce(y, self.tp) if self.reduce else y


class ParallelLMHead(ColumnParallelLinear):
    def __init__(self, hidden_size: int, vocab_size: int):
        start, size = split(vocab_size, current())
        super().__init__(hidden_size, {None: (vocab_size, start, size)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.gather_vocab(super().forward(x), self.tp)


def column_linear(in_features: int, sizes: dict[str, int], bias: bool = False) -> ColumnParallelLinear:
    """A fused column-parallel layer whose parts (gate, up) each split evenly over the ranks."""
    tp = current()
    return ColumnParallelLinear(in_features, {n: (s, *split(s, tp)) for n, s in sizes.items()}, bias)


def qkv_linear(hidden: int, nh: int, nkv: int, hd: int, bias: bool = False) -> ColumnParallelLinear:
    """The fused q/k/v projection: this rank's query heads and the KV heads they read (parallel_state)."""
    tp = current()
    q0, nq = split(nh, tp)
    k0, nk = kv_heads_split(nh, nkv, tp)
    parts = {"q": (nh * hd, q0 * hd, nq * hd), "k": (nkv * hd, k0 * hd, nk * hd), "v": (nkv * hd, k0 * hd, nk * hd)}
    return ColumnParallelLinear(hidden, parts, bias)


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding over this rank's rows [start, start + V/tp) of the table."""

    def __init__(self, vocab_size: int, hidden_size: int):
        tp = current()
        self.vocab_start, local = split(vocab_size, tp)
        super().__init__(local, hidden_size)
        self.tp = tp

    def load(self, kind: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if kind != "weight" or shard is not None:
            raise ValueError(f"an embedding takes a weight, not {kind!r}")
        if self.tp.size > 1:
            tensor = tensor.narrow(0, self.vocab_start, self.num_embeddings)
        if self.weight.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading the embedding: checkpoint {tuple(tensor.shape)} vs model "
                             f"{tuple(self.weight.shape)}")
        self.weight.data.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The table may be a tied output head's, held in AMX tile order (layers/bf16_linear.py): the lookup reads it
        if self.tp.size == 1:
            return bf16_linear.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = bf16_linear.embedding(local.masked_fill(outside, 0), self.weight)
        return comm.all_reduce(rows.masked_fill(outside[:, None], 0), self.tp)  # exactly one rank adds each row
