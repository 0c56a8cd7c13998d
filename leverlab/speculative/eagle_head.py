"""The EAGLE head: one decoder layer that drafts from the target's own hidden states (EAGLE-3 style).

Inputs at head row i (aligned with target position i):
  feature  F_i = fc(concat(aux layer outputs of the target at position i))   [T, A*H] -> [T, H]
  token    x_{i+1} (the token after position i), embedded by the TARGET's embedding (shared, not stored)
The layer's qkv projection reads concat(norm(embed), norm(feature)) [T, 2H] (EAGLE-3's choice: token and
feature reach attention side by side for the price of one wider matmul, no extra fc over the pair); the
residual stream starts from the feature. Its output h_i (before the final norm) predicts x_{i+2} through the
TARGET's lm_head after `norm`, and is fed back as the feature of row i+1 when drafting further ahead
(the target's real feature for that position does not exist yet).

Our folder holds config.json (the target's shape, the aux layer ids, the layer's shape) and model.safetensors
with only the head's weights. Heads in the formats the rest of the world writes (the `speculators` format and
the original EAGLE-3 release, speculative/eagle3_format.py) load into this same module; they may bring their own
lm_head over a reduced draft vocabulary (with the map back to target ids), their own embedding, and a few
norm switches, all off for our own heads. Shapes: T rows, H = hidden size, A = len(aux_layer_ids),
D = head_dim, Vd = draft vocabulary.

Aux layer ids here mean "the output of decoder layer i" (CausalLM.aux_layers). vLLM and `speculators` count
"the residual stream entering layer i", one more: the formats module converts at the boundary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from leverlab.errors import UnsupportedLever
from leverlab.layers.attention import paged_attention
from leverlab.layers.linear import Linear, packed
from leverlab.layers.norm import RMSNorm
from leverlab.layers.rotary import Rotary, check_scaling
from leverlab.models.config import ModelConfig
from leverlab.models.loader import default_dtype

ARCHITECTURE = "LeverLabEagleHead"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """A low, the middle and the second-highest decoder layer's outputs (deduplicated for very shallow models).
    EAGLE-3 takes (2, L/2, L-3) in vLLM's count, i.e. outputs (1, L/2-1, L-4). We go as high as vLLM can
    capture: on a small target the top layers carry most of the next-token information and the head has little
    capacity to rebuild them, but vLLM only sees the stream entering layers 0..L-1, so the top layer's own
    output (our first heads used it) cannot be exported for vLLM (speculative/eagle3_format.py)."""
    if num_layers <= 3:
        return tuple(range(num_layers))
    return tuple(sorted({1, num_layers // 2, num_layers - 2}))


@dataclass
class EagleConfig:
    # The target it was trained for: checked at load, since features and the shared lm_head must fit
    # (None for heads from other formats, which do not record them).
    target_architecture: str | None
    target_num_layers: int | None
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    # The head's own layer (by default the target's layer shape).
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    qk_norm: bool
    dtype: str = "bfloat16"  # of the stored weights
    # Heads from other formats (speculative/eagle3_format.py); the defaults are our own heads' choices.
    target_hidden_size: int | None = None  # the target's hidden size when it differs from the head's
    draft_vocab_size: int | None = None  # the head's own lm_head [Vd, H] and a draft->target id map; None: shared
    own_embedding: bool = False  # the head's own embedding table instead of the target's
    attention_bias: bool = False
    norm_before_residual: bool = False  # the residual starts from the normed feature
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux features before fc
    fc_norm: bool = False  # one RMSNorm per aux feature before fc
    norm_output: bool = False  # feed back the normed hidden state when drafting further ahead
    source_format: str = "leverlab"  # leverlab | speculators | eagle3 (where the weights came from)

    @classmethod
    def for_target(cls, target: ModelConfig, aux_layer_ids: tuple[int, ...] | None = None) -> EagleConfig:
        aux = tuple(aux_layer_ids) if aux_layer_ids else default_aux_layers(target.num_layers)
        if not aux or any(not 0 <= i < target.num_layers for i in aux):
            raise ValueError(f"aux layer ids {aux} must lie in [0, {target.num_layers})")
        return cls(target.architecture, target.num_layers, target.vocab_size, aux, target.hidden_size,
                   target.num_heads, target.num_kv_heads, target.head_dim, target.intermediate_size,
                   target.rms_norm_eps, target.rope_theta, target.rope_scaling, target.max_position_embeddings,
                   target.qk_norm)

    @classmethod
    def from_folder(cls, path: str | Path) -> EagleConfig:
        f = Path(path) / "config.json"
        if not f.is_file():
            raise UnsupportedLever(f"EAGLE head folder {path} has no config.json (train one: leverlab train-eagle)")
        raw = json.loads(f.read_text())
        if ARCHITECTURE not in raw.get("architectures", []):
            raise UnsupportedLever(f"{path} is not an EAGLE head (architectures {raw.get('architectures')}); "
                                   "for a separate draft model use method \"draft_model\"")
        known = {x.name for x in fields(cls)}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        cfg.aux_layer_ids = tuple(cfg.aux_layer_ids)
        return cfg

    def to_json(self) -> dict:
        return {"architectures": [ARCHITECTURE], "model_type": "leverlab-eagle", **asdict(self),
                "aux_layer_ids": list(self.aux_layer_ids)}

    @property
    def feature_size(self) -> int:
        """The target hidden size the features (aux layer outputs) have."""
        return self.target_hidden_size or self.hidden_size

    def check_target(self, target: ModelConfig, path: str) -> None:
        if self.target_architecture is not None:
            got = (target.architecture, target.num_layers, target.hidden_size, target.vocab_size)
            want = (self.target_architecture, self.target_num_layers, self.hidden_size, self.vocab_size)
            if got != want:
                raise UnsupportedLever(f"EAGLE head {path} was trained for a target with (architecture, layers, "
                                       f"hidden, vocab) = {want}; this target has {got}")
        if (target.hidden_size, target.vocab_size) != (self.feature_size, self.vocab_size):
            raise UnsupportedLever(f"EAGLE head {path} reads features of size {self.feature_size} over a vocabulary "
                                   f"of {self.vocab_size}; this target has hidden size {target.hidden_size} and "
                                   f"vocabulary {target.vocab_size}")
        if self.hidden_size != target.hidden_size and not self.own_embedding:
            raise UnsupportedLever(f"EAGLE head {path} (hidden {self.hidden_size}) differs from the target "
                                   f"({target.hidden_size}) and brings no embedding of its own")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise UnsupportedLever(f"EAGLE head {path} reads target layers {list(self.aux_layer_ids)} (outputs); "
                                   f"this target has {target.num_layers} layers")


class MLP(nn.Module):
    """SwiGLU, as the target's; plain layers (the head always runs at parallel degree 1)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        rows, shards = packed({"gate": intermediate, "up": intermediate})
        self.gate_up_proj = Linear(hidden, rows, shards=shards)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig, max_len: int | None = None):
        """max_len: the engine's max_model_len, which the head's rotary tables cover (None: its own default)."""
        super().__init__()
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a, f = len(cfg.aux_layer_ids), cfg.feature_size
        self.input_norm = RMSNorm(a * f, eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(f, eps) for _ in range(a)) if cfg.fc_norm else None
        self.fc = Linear(a * f, h)
        self.embed_norm = RMSNorm(h, eps)
        self.feature_norm = RMSNorm(h, eps)
        rows, shards = packed({"q": self.nh * self.hd, "k": self.nkv * self.hd, "v": self.nkv * self.hd})
        self.qkv_proj = Linear(2 * h, rows, bias=cfg.attention_bias, shards=shards)
        self.q_norm = RMSNorm(self.hd, eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, eps) if cfg.qk_norm else None
        self.o_proj = Linear(self.nh * self.hd, h, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if cfg.own_embedding else None
        self.lm_head = Linear(h, cfg.draft_vocab_size) if cfg.draft_vocab_size else None
        if cfg.draft_vocab_size:
            # [Vd] the target id of each draft id (the checkpoint's d2t holds offsets: target = draft + d2t)
            self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))
        # The head's own rope (a head trained here copies the target's), scaled the way its config says, over the
        # positions of the target's sequences.
        try:
            scaling = check_scaling(cfg.rope_scaling, self.hd, cfg.max_position_embeddings)
        except ValueError as e:
            raise UnsupportedLever(f"EAGLE head: {e}") from None
        self.rotary = Rotary(self.hd, cfg.rope_theta, scaling, cfg.max_position_embeddings, max_len)
        self.scale = self.hd**-0.5

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [T, A*F] target aux outputs -> [T, H] feature
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """The feature of the next draft row, from this row's output h [T, H]."""
        return self.norm(h) if self.config.norm_output else h

    def project(self, positions, embeds, features):
        """positions [T], embeds [T, H], features [T, H] -> q [T, nh, D], k and v [T, nkv, D] (rotated)."""
        t = embeds.shape[0]
        x = torch.cat([self.embed_norm(embeds), self.feature_norm(features)], dim=-1)  # [T, 2H]
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k, v = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd), v.view(t, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def finish(self, features, attn):
        """features [T, H] (the residual), attn [T, nh, D] -> the head's hidden state h [T, H] (pre-norm)."""
        residual = self.feature_norm(features) if self.config.norm_before_residual else features
        x = residual + self.o_proj(attn.reshape(attn.shape[0], self.nh * self.hd))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, positions, embeds, features):
        """Inference, inside forward_context() with the head's own one-layer paged cache (layer 0)."""
        q, k, v = self.project(positions, embeds, features)
        return self.finish(features, paged_attention(q, k, v, 0, self.scale, 0))


def init_head(head: EagleHead, seed: int = 0, std: float = 0.02) -> EagleHead:
    """Fresh weights: normal(0, std) matrices, unit norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.ndim >= 2 and "embed" in name:
                p.normal_(0.0, 1.0, generator=g)
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    return head


def save_head(head: EagleHead, path: str | Path, dtype: str = "bfloat16") -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    state = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    cfg = head.config
    cfg.dtype = dtype
    (path / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")


def build_head(cfg: EagleConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, path,
               max_len: int | None = None) -> EagleHead:
    """The head from its config and a state dict in our names (speculative/eagle3_format.py converts theirs)."""
    with default_dtype(dtype):  # parameters in the engine's dtype; rotary tables stay float32
        head = EagleHead(cfg, max_len)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UnsupportedLever(f"EAGLE head {path}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    return head
