"""The EAGLE head: one decoder layer that drafts from the target's own hidden states (EAGLE-3 style).

Inputs at head row i (aligned with target position i):
  feature  F_i = fc(concat(aux layer outputs of the target at position i))   [T, A*H] -> [T, H]
  token    x_{i+1} (the token after position i), embedded by the TARGET's embedding (shared, not stored)
The layer's qkv projection reads concat(norm(embed), norm(feature)) [T, 2H] (EAGLE-3's choice: token and
feature reach attention side by side for the price of one wider matmul, no extra fc over the pair); the
residual stream starts from the feature. Its output h_i (before the final norm) predicts x_{i+2} through the
TARGET's lm_head after `norm`, and is fed back as the feature of row i+1 when drafting further ahead
(the target's real feature for that position does not exist yet).

The folder holds config.json (the target's shape, the aux layer ids, the layer's shape) and model.safetensors
with only the head's weights. Shapes: T rows, H = hidden size, A = len(aux_layer_ids), D = head_dim.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from leverlab.errors import UnsupportedLever
from leverlab.layers.attention import paged_attention
from leverlab.layers.linear import Linear, packed
from leverlab.layers.norm import RMSNorm
from leverlab.layers.rotary import Rotary
from leverlab.models.config import ModelConfig

ARCHITECTURE = "LeverLabEagleHead"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and the top decoder layer (deduplicated for very shallow models). EAGLE-3 takes
    (2, L/2, L-3); we keep the top layer: on a small target its output carries most of the next-token
    information and the head has little capacity to rebuild what the last layers add."""
    return tuple(sorted({1 if num_layers > 3 else 0, num_layers // 2, num_layers - 1}))


@dataclass
class EagleConfig:
    # The target it was trained for: checked at load, since features and the shared lm_head must fit.
    target_architecture: str
    target_num_layers: int
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

    def check_target(self, target: ModelConfig, path: str) -> None:
        got = (target.architecture, target.num_layers, target.hidden_size, target.vocab_size)
        want = (self.target_architecture, self.target_num_layers, self.hidden_size, self.vocab_size)
        if got != want:
            raise UnsupportedLever(f"EAGLE head {path} was trained for a target with (architecture, layers, hidden, "
                                   f"vocab) = {want}; this target has {got}")


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
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fc = Linear(len(cfg.aux_layer_ids) * h, h)
        self.embed_norm = RMSNorm(h, eps)
        self.feature_norm = RMSNorm(h, eps)
        rows, shards = packed({"q": self.nh * self.hd, "k": self.nkv * self.hd, "v": self.nkv * self.hd})
        self.qkv_proj = Linear(2 * h, rows, shards=shards)
        self.q_norm = RMSNorm(self.hd, eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, eps) if cfg.qk_norm else None
        self.o_proj = Linear(self.nh * self.hd, h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, eps)
        self.rotary = Rotary(self.hd, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.scale = self.hd**-0.5

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [T, A*H] target aux outputs -> [T, H] feature
        return self.fc(aux)

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
        x = features + self.o_proj(attn.reshape(attn.shape[0], self.nh * self.hd))
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
            if p.ndim >= 2:
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


def load_head(path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> EagleHead:
    from leverlab.models.loader import _default_dtype

    cfg = EagleConfig.from_folder(path)
    with _default_dtype(dtype):  # parameters in the engine's dtype; rotary tables stay float32
        head = EagleHead(cfg)
    state = load_file(str(Path(path) / "model.safetensors"))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UnsupportedLever(f"EAGLE head {path}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    return head.to(device=device).eval()


def aux_layers_for(engine_config) -> tuple[int, ...]:
    """Target layers whose outputs the model must return next to its hidden states: the EAGLE head's aux
    layers when eagle speculation is configured, else none (the plain forward returns hidden only)."""
    raw = engine_config.speculative_config
    if not raw:
        return ()
    from leverlab.spec.config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(raw)
    if spec.method != "eagle":
        return ()
    return EagleConfig.from_folder(spec.model).aux_layer_ids
