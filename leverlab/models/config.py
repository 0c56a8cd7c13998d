"""ModelConfig: the architecture facts our model code needs, read from a Hugging Face config.json (or from a GGUF
file's metadata, gguf_file.py, which gives the same keys).

One decoder covers Qwen3, Qwen2/2.5, Llama 3 and the mixture-of-experts Qwen3-MoE, Qwen2-MoE and Mixtral; they
differ only in the switches below. Adding an architecture is adding an entry to ARCHITECTURES.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from leverlab.layers import rotary
from leverlab.models import gguf_file

# HF architecture name -> the switches that tell its decoder apart.
ARCHITECTURES: dict[str, dict] = {
    "Qwen3ForCausalLM": {"qk_norm": True, "qkv_bias": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "qkv_bias": True},
    "LlamaForCausalLM": {"qk_norm": False, "qkv_bias": None},  # None: read attention_bias
    "MistralForCausalLM": {"qk_norm": False, "qkv_bias": False},
    # Mixture of experts (decoder.SparseMoE). "moe" names the routing: "qwen" casts the routing weights back to
    # the model dtype before they scale an expert's output, "mixtral" keeps them in float32 (as transformers does).
    "Qwen3MoeForCausalLM": {"qk_norm": True, "qkv_bias": False, "moe": "qwen"},
    "Qwen2MoeForCausalLM": {"qk_norm": False, "qkv_bias": True, "moe": "qwen", "shared_expert": True},
    "MixtralForCausalLM": {"qk_norm": False, "qkv_bias": False, "moe": "mixtral"},
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    sliding_window: int | None
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # Mixture of experts (all zero / empty for a dense model). sparse_layers: per layer, whether its MLP is the
    # routed block (Qwen2-MoE's decoder_sparse_step and mlp_only_layers leave some layers dense, at
    # intermediate_size); moe_intermediate_size: one expert's width; shared_expert_intermediate_size: Qwen2-MoE's
    # always-on expert (0: none), whose output a sigmoid gate scales.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    router_float32_weights: bool = False  # Mixtral: the routing weights scale expert outputs in float32
    sparse_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @classmethod
    def from_folder(cls, path: str | Path, trust_remote_code: bool = False) -> ModelConfig:
        """trust_remote_code (vLLM's switch) changes nothing but the reason given for an architecture we do not
        implement: our own code is all that ever runs, never a repository's."""
        path = Path(path)
        if gguf_file.is_gguf(path):
            cfg_file, raw = path, gguf_file.hf_config(path)
            eos = tuple(raw.pop("eos_token_id"))
        else:
            cfg_file = path / "config.json"
            if not cfg_file.is_file():
                raise FileNotFoundError(f"{path} is not a model folder (it has no config.json) nor a GGUF file")
            raw = json.loads(cfg_file.read_text())
            eos = _eos_ids(path, raw)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            why = (" trust_remote_code is accepted only for these: LeverLab runs its own implementation of an "
                   "architecture, never model code from the checkpoint's repository") if trust_remote_code else ""
            raise ValueError(
                f"unsupported architecture {archs!r} in {cfg_file}; supported: {sorted(ARCHITECTURES)}.{why}"
            )
        switches = ARCHITECTURES[arch]
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        max_positions = raw.get("max_position_embeddings", 4096)
        try:
            theta, scaling = read_rope(raw, head_dim, max_positions)
        except ValueError as e:
            raise ValueError(f"{cfg_file}: {e}") from None
        qkv_bias = switches["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = bool(raw.get("attention_bias", False))
        mistral_like = arch in ("MistralForCausalLM", "MixtralForCausalLM")  # no use_sliding_window switch
        window = raw.get("sliding_window") if raw.get("use_sliding_window", mistral_like) else None
        n_layers = raw["num_hidden_layers"]
        # Which layers slide: `layer_types` where the config lists them (transformers 5), else Qwen2's rule
        # (layers from max_window_layers on), else all of them (Mistral).
        types = raw.get("layer_types")
        if window is None:
            windows = (None,) * n_layers
        elif types:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        elif "max_window_layers" in raw:
            windows = tuple(window if i >= raw["max_window_layers"] else None for i in range(n_layers))
        else:
            windows = (window,) * n_layers
        moe = _moe_facts(raw, switches, n_layers)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=switches["qk_norm"],
            qkv_bias=qkv_bias,
            sliding_window=window,
            layer_windows=windows,
            eos_token_ids=eos,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            **moe,
        )

    @property
    def max_context(self) -> int:
        """The longest --max-model-len this model takes: max_position_embeddings, stretched by its rope scaling
        (layers/rotary.py: max_context)."""
        return rotary.max_context(self.rope_scaling, self.max_position_embeddings)

    @property
    def default_max_len(self) -> int:
        """max_model_len when none is given (layers/rotary.py: default_max_len)."""
        return rotary.default_max_len(self.rope_scaling, self.max_position_embeddings)

    def weight_bytes(self, bytes_per_param: float) -> int:
        """Bytes read per decode step at batch 1: every weight once (the tied head counts once); of a
        mixture-of-experts model, the active weights only (active_params)."""
        return int(self.num_params(active=True) * bytes_per_param)

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """The matmul weights of one layer's MLP: the dense MLP, or the routed block's experts (with active, the
        num_experts_per_tok a token reads) plus its shared expert."""
        h = self.hidden_size
        if not (self.sparse_layers and self.sparse_layers[layer]):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return 3 * h * (experts * self.moe_intermediate_size + self.shared_expert_intermediate_size)

    def linear_params(self, active: bool = False) -> int:
        """The decoder layers' matmul weights (what quantization shrinks): attention and MLPs."""
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h
        return sum(attn + self.mlp_params(i, active) for i in range(self.num_layers))

    def num_params(self, active: bool = False) -> int:
        """All weights; with `active`, those one token reads: of a mixture-of-experts model the shared expert and
        num_experts_per_tok experts per sparse layer, not all of them. That is an estimate of a decode step's
        reads at batch 1: a batch reads every expert any of its tokens chose (up to all of them), which the engine
        counts from the router's choices per decode pass (models/expert_reads.py, on /metrics)."""
        h, v = self.hidden_size, self.vocab_size
        sparse = sum(self.sparse_layers)
        router = sparse * h * (self.num_experts + (1 if self.shared_expert_intermediate_size else 0))
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.linear_params(active) + router + self.num_layers * 2 * h + emb + h


def _moe_facts(raw: dict, switches: dict, n_layers: int) -> dict:
    """The ModelConfig fields of a mixture-of-experts config.json (none for a dense model). Qwen3-MoE configs
    written by transformers 5 name the expert count num_local_experts, as Mixtral's do; Qwen's own num_experts."""
    routing = switches.get("moe")
    if routing is None:
        return {}
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    top_k = raw.get("num_experts_per_tok")
    if not experts or not top_k or not 0 < top_k <= experts:
        raise ValueError(f"mixture-of-experts config with num_experts {experts!r} and num_experts_per_tok {top_k!r}")
    if routing == "mixtral":  # every layer routed, each expert intermediate_size wide, always renormalized
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, router_float32_weights=True, sparse_layers=(True,) * n_layers)
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                # Qwen2-MoE always has one (transformers' default width 5632); Qwen3-MoE never.
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 5632)
                if switches.get("shared_expert") else 0,
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse)


def read_rope(raw: dict, head_dim: int, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, scaling as layers/rotary.check_scaling returns it) from a config dict: transformers 5 writes
    rope_parameters, older checkpoints rope_theta + rope_scaling. ValueError for a scheme we do not implement."""
    rope = dict(raw.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or rope
    return theta, rotary.check_scaling(scaling, head_dim, max_positions, raw.get("original_max_position_embeddings"))


def _eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json wins over config.json (it lists chat end tokens too)."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    for source in ((json.loads(gen.read_text()) if gen.is_file() else {}), raw):
        e = source.get("eos_token_id")
        if e is None:
            continue
        for t in e if isinstance(e, list) else [e]:
            if t not in ids:
                ids.append(int(t))
    return tuple(ids)
