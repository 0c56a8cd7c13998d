"""One plain-torch decoder for Qwen3, Qwen2/2.5, Llama 3 and their mixture-of-experts kin (switches in ModelConfig;
the routed MLP block is models/moe.py).

Parameter names follow Hugging Face's (model.layers.N.self_attn..., lm_head) except that q/k/v and
gate/up are packed into one matrix each: one matmul instead of three (or two) per layer.
Shapes: T = tokens in the step (all sequences flattened), H = hidden, D = head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leverlab.distributed.parallel_state import current as current_tp
from leverlab.distributed.parallel_state import local_kv_heads
from leverlab.layers.attention import paged_attention
from leverlab.layers.norm import RMSNorm
from leverlab.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_linear,
    qkv_linear,
)
from leverlab.layers.rotary import Rotary
from leverlab.models.config import ModelConfig
from leverlab.models.moe import Router, SparseMoE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, layer: int):
        super().__init__()
        self.layer = layer
        tp = current_tp().size  # tensor parallel: this rank's heads only (distributed/parallel_state.py)
        self.nh, self.nkv, self.hd = cfg.num_heads // tp, local_kv_heads(cfg.num_heads, cfg.num_kv_heads, tp), cfg.head_dim
        self.qkv_proj = qkv_linear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, self.hd, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.hd, cfg.hidden_size)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = self.hd**-0.5
        self.window = cfg.layer_windows[layer] or 0  # 0: full attention

    def forward(self, positions, x):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k, v = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd), v.view(t, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, self.layer, self.scale, self.window)  # [T, nh, D]; K/V go to the paged cache
        return self.o_proj(o.view(t, self.nh * self.hd))


class MLP(nn.Module):
    """The gated MLP: a dense layer's, one expert's, or Qwen2-MoE's shared expert's (`intermediate` wide).
    reduce=False (an MoE layer's experts): at TP > 1 it returns this rank's partial output, which SparseMoE sums
    over the ranks once for the whole layer."""

    def __init__(self, hidden: int, intermediate: int, reduce: bool = True):
        super().__init__()
        self.gate_up_proj = column_linear(hidden, {"gate": intermediate, "up": intermediate})
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce=reduce)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = sparse_moe(cfg) if cfg.sparse_layers and cfg.sparse_layers[layer] else MLP(
            cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions, x):
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def sparse_moe(cfg: ModelConfig) -> SparseMoE:
    h = cfg.hidden_size
    router = Router(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.router_float32_weights)
    # Tensor parallel: every expert (and the shared expert) sharded as a dense MLP, 1/tp of its width per rank, the
    # router and the shared expert's gate replicated; the partial outputs are all-reduced once per layer (moe.py).
    shared = MLP(h, cfg.shared_expert_intermediate_size, reduce=False) if cfg.shared_expert_intermediate_size else None
    experts = [MLP(h, cfg.moe_intermediate_size, reduce=False) for _ in range(cfg.num_experts)]
    return SparseMoE(router, experts, shared)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        # One table for every layer, fixed for the engine's max_model_len (layers/rotary.py says why).
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, max_len)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    # checkpoint name -> (our module name, shard id) for weights packed into one matrix
    PACKED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        """max_len: the engine's max_model_len, which dynamic and longrope rope scaling are fixed for (None: the
        model's default, ModelConfig.default_max_len)."""
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, max_len)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)  # at TP > 1 rank 0 gets all V logits
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # EAGLE speculation (speculative/eagle_head.py): layers whose outputs forward() also returns. Set before the
    # forward is compiled; empty (the default) keeps the plain signature.
    aux_layers: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """input_ids, positions [T] -> final normed hidden states [T, H]; with aux_layers, the pair
        (hidden [T, H], the aux layers' outputs concatenated [T, len(aux_layers) * H]).
        Runs inside forward_context()."""
        x = self.model.embed_tokens(input_ids)
        aux = []
        for i, layer in enumerate(self.model.layers):
            x = layer(positions, x)
            if i in self.aux_layers:
                aux.append(x)
        hidden = self.model.norm(x)
        return (hidden, torch.cat(aux, dim=-1)) if aux else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        return self.lm_head(hidden).float()
