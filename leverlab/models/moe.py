"""The mixture-of-experts block: a router picks num_experts_per_tok experts per token, their gated MLPs run on it,
and their outputs add up weighted by the router's probabilities (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral).

Compute is grouped by expert, not by token: the (token, expert) pairs of a step (a decode batch, a prefill chunk,
a verification batch) are sorted by expert, and each expert that any token chose runs one matmul over all its
tokens. An expert chosen by several sequences of a decode batch is read once per step, and a prefill chunk runs a
GEMM per hit expert instead of a matmul per token. The Python loop is over the hit experts (at most num_experts),
never over tokens.

Each expert is an ordinary gated MLP of our Linear layers (decoder.MLP), so every quantization method (int8, int4,
...) quantizes it per expert with the kernels a dense layer uses, and the loader reads Hugging Face's per-expert
tensors into it without a copy. For decode-sized steps on the CPU the hit experts run in one C++ call per layer
instead (`kernel`, set by models/fused.py fused_moe: csrc/fused_decoder.cpp MoeExperts), which takes each expert's
linears the way the fused decoder takes a dense layer's, (kind, weight, scale), and repeats expert_outputs() op for
op without its Python frames per expert; this module's loop stays the reference and the path of larger steps.

Tensor parallel (--tensor-parallel-size N): each rank holds every expert's 1/N slice of its width (gate/up
column-parallel, down row-parallel, decoder.MLP with reduce=False), and the shared expert's likewise; the router and
the shared expert's sigmoid gate are replicated, so every rank routes alike. Each rank's routed and shared outputs
are partial sums (linear in the down projection's inputs, so the routing weights and the gate scale them as they
would the whole), added up by ONE all-reduce per layer, not one per expert (so the collectives a step makes never
depend on its routing: ranks cannot fall out of step). The C++ op runs on a rank's shard as on a whole model: a
sharded expert is a narrower expert.

The routing math is transformers' op for op: router logits in the model dtype, softmax in float32, torch.topk
(ties resolve as it resolves them there), optional renormalization, the weights cast back to the model dtype
(Qwen) or kept in float32 (Mixtral) before they scale each expert's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leverlab.distributed import comm
from leverlab.distributed.parallel_state import current as current_tp


class Router(nn.Module):
    """The gate: a [num_experts, hidden] matrix, kept in the model dtype (no quantization method touches it:
    routing decisions stay those of the checkpoint's weights)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, float32_weights: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], chosen experts [T, k] int64)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(logits.dtype)
        return weights, experts


class SparseMoE(nn.Module):
    """`experts`: one gated MLP module per expert ([n, H] -> [n, H]). `shared_expert` (Qwen2-MoE): an MLP every token
    runs, its output scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, router: Router, experts: list[nn.Module], shared_expert: nn.Module | None = None):
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(experts)
        self.shared_expert = shared_expert
        hidden = router.weight.shape[1]
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
        self.kernel = None  # the C++ MoeExperts over these experts (models/fused.py fused_moe), or None
        self.kernel_rows = 0  # the most tokens a step may have to take it
        self.reads = None  # models/expert_reads.py ExpertReads: counts the experts decode passes read, or None
        self.tp = current_tp()  # the experts' shards hold partial sums at TP > 1: forward() reduces them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = routed_outputs(self, x, weights, chosen)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return comm.all_reduce(out, self.tp)


def group_by_expert(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """chosen [T, k] -> (order [T * k]: the flat (token, slot) pairs sorted by expert, stably, so that an expert's
    tokens keep their order; the hit experts in increasing order; how many pairs each of them has). One host sync
    (the counts), whatever the batch."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    hit = counts.nonzero().flatten()
    return order, hit.tolist(), counts[hit].tolist()


@torch.compiler.disable  # an opaque native call, and the loop below: eager under --execution-mode compiled
def routed_outputs(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """expert_outputs(), in one C++ call when the layer has its kernel and the step is short enough."""
    if moe.reads is not None:
        moe.reads.record(moe, chosen)
    if moe.kernel is not None and x.dim() == 2 and x.shape[0] <= moe.kernel_rows:
        return moe.kernel.forward(x, weights, chosen)
    return expert_outputs(x, weights, chosen, moe.experts)


# Eager under --execution-mode compiled: the loop's length is the number of experts a step hit, which Dynamo would
# guard on and recompile for at every new count (hitting its recompile limit within a few steps); the router and
# the rest of the layer stay in the graph.
@torch.compiler.disable
def expert_outputs(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum over each token's chosen experts of weight * expert(x), computed expert by expert."""
    order, hit, sizes = group_by_expert(chosen, len(experts))
    if not hit:  # no tokens
        return torch.zeros_like(x)
    token = order // chosen.shape[1]
    rows = x.index_select(0, token)  # [T * k, H], grouped by expert
    y = torch.cat([experts[e](part) for e, part in zip(hit, rows.split(sizes))])
    # The product in the weights' dtype, then the model's (transformers: per expert, before its index_add_).
    y = (y * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
    # Each token's contributions are added in increasing expert order, as transformers adds them.
    return torch.zeros_like(x).index_add_(0, token, y)
