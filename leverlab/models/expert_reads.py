"""The weight bytes a mixture-of-experts decode pass really reads, counted from the router's choices.

A dense decode pass reads every weight once. A mixture-of-experts pass reads its attention, norms, routers, shared
experts and head (the fixed part) plus every routed expert that any of its tokens chose: num_experts_per_tok
experts per sparse layer at one sequence, up to all of them in a batch. ModelConfig.num_params(active=True) can only
estimate the first case; this module counts what happened.

ExpertReads sits on every SparseMoE of the model (`moe.reads`); models/moe.py routed_outputs hands it the router's
choices on both of its paths (the Python loop and the C++ MoeExperts op). The model runner brackets each pass with
begin() / end() and counts decode passes only: passes whose every token is sampled (decode, speculative
verification). Prefill chunks hit nearly every expert and are not what a decode roofline is about. The totals are
engine counters (counters(): leverlab_engine_moe_*_total on /metrics); weight bytes per decode pass is
moe_weight_bytes_read / moe_decode_passes.

A layer's distinct experts come from its choices as a Python set: routing tensors on the CPU make `tolist()` of a
decode step's [T, k] ids a few microseconds and no device sync; on a GPU it is one more sync right before
group_by_expert's own, which then finds the queue drained. A pass in which some sparse layer did not report (its
experts ran where Python cannot see them, e.g. a fused C++ step that does not hand its counts to record_hits) is left
out whole (`unseen`), so a per-pass average never mixes counted and uncounted layers.
"""

from __future__ import annotations

import torch
from torch import nn

from leverlab.layers.linear import Linear
from leverlab.models.moe import SparseMoE


def linear_bytes(lin: Linear, rows: int = 1) -> int:
    """Bytes one matmul of `rows` rows reads from this linear: its quantization method's kernel layout (scales
    included), else every parameter of it."""
    if lin.quant_method is not None:
        return lin.quant_method.bytes_read(lin, rows)
    return sum(p.numel() * p.element_size() for p in lin.parameters())


def expert_bytes(moe: SparseMoE) -> int:
    """Bytes one routed expert of this layer reads in a decode pass, its tokens (one per sequence, a few at most) on
    the streaming kernels: the mean over the layer's experts, which share one shape and one method."""
    each = [sum(linear_bytes(m) for m in e.modules() if isinstance(m, Linear)) for e in moe.experts]
    return round(sum(each) / max(1, len(each)))


def fixed_bytes(model: nn.Module) -> int:
    """What every decode pass reads besides the routed experts: attention, norms, routers, shared experts and their
    gates, dense MLP layers, the output head (a tied head reads the embedding table: counted there, once). The
    embedding lookup reads a row per token and is left out."""
    routed = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.experts.modules()}
    embed = model.model.embed_tokens
    seen: set[int] = set()  # data pointers of the plain parameters counted
    total = 0
    for m in model.modules():
        if id(m) in routed or m is embed:
            continue
        if isinstance(m, Linear):  # each Linear module once; a tied head is the one reader of the table
            total += linear_bytes(m)
            continue
        for p in m.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


class ExpertReads:
    """Counts the routed experts each decode pass reads and the bytes that makes. `fixed`: fixed_bytes(model);
    `per_expert`: SparseMoE -> expert_bytes of that layer."""

    def __init__(self, fixed: int, per_expert: dict[SparseMoE, int]):
        self.fixed, self.per_expert = fixed, per_expert
        self.counting = False
        self.passes = 0  # decode passes counted
        self.experts = 0  # distinct routed experts read, summed over sparse layers and counted passes
        self.bytes = 0  # weight bytes those passes read: fixed + the experts they hit
        self.unseen = 0  # decode passes left out: not every sparse layer reported its choices
        self._layers = self._experts = self._bytes = 0

    def begin(self, decode: bool) -> None:
        """A pass starts; count it if it is a decode pass."""
        self.counting = decode
        self._layers = self._experts = self._bytes = 0

    def record(self, moe: SparseMoE, chosen: torch.Tensor) -> None:
        """One sparse layer's router chose `chosen` [T, k] in this pass."""
        if self.counting:
            self.record_hits(moe, len(set(chosen.reshape(-1).tolist())))

    def record_hits(self, moe: SparseMoE, n: int) -> None:
        """One sparse layer read `n` distinct routed experts in this pass: for a path that routes out of Python's
        sight (a fused C++ step) and counts them there."""
        if not self.counting:
            return
        self._layers += 1
        self._experts += n
        self._bytes += n * self.per_expert[moe]

    def end(self) -> None:
        if self.counting:
            if self._layers == len(self.per_expert):
                self.passes += 1
                self.experts += self._experts
                self.bytes += self.fixed + self._bytes
            else:
                self.unseen += 1
        self.counting = False

    def counters(self) -> dict[str, float]:
        """Engine counters (leverlab_engine_<name>_total on /metrics)."""
        return {"moe_decode_passes": self.passes, "moe_experts_read": self.experts,
                "moe_weight_bytes_read": self.bytes, "moe_decode_passes_uncounted": self.unseen}


def attach(model: nn.Module) -> ExpertReads | None:
    """An ExpertReads over `model`'s sparse layers, set on each of them (None for a dense model). Call it after the
    quantization methods are attached and their kernels packed: the bytes are those of the layouts the kernels
    read."""
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not moes:
        return None
    reads = ExpertReads(fixed_bytes(model), {m: expert_bytes(m) for m in moes})
    for m in moes:
        m.reads = reads
    return reads
