"""Rotary position embedding (the non-interleaved "rotate half" form) and the context-extension schemes a
checkpoint's `rope_scaling` / `rope_parameters` names: linear, dynamic (NTK), yarn, longrope and llama3, with
the math of transformers' modeling_rope_utils (written here from its description, not copied).

A paged engine keeps each token's rotated key in the KV cache (and shares it across requests through the prefix
cache), so one table must serve every sequence from position 0 to the engine's max_model_len. transformers
recomputes two of the schemes by the sequence's current length instead; here they are fixed once for `max_len`
(the engine's --max-model-len). vLLM fixes both too, longrope by the same rule (docs/engine.md says how its
dynamic differs):
- dynamic: the NTK base transformers uses for a sequence of `max_len` tokens, at every position. Equal to
  transformers for a whole forward of that length, and to plain RoPE (transformers' choice for any sequence
  within max_position_embeddings) when max_len <= max_position_embeddings.
- longrope: the long factors for every position when max_len > original_max_position_embeddings, else the short
  ones (vLLM's rule: a sequence crossing the original length would otherwise change the keys already cached).
yarn and longrope scale cos/sin by their attention factor (mscale); the tables hold the scaled values, so every
path that reads them (the module forward, the fused C++ step, EAGLE heads) applies it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# rope_type -> (keys it needs, keys it may have). Anything else in the dict is refused, never dropped: a key we
# ignore could change the model's positions.
ROPE_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
    "longrope": (frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
                 frozenset({"factor", "attention_factor"})),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
               frozenset()),
}
# Keys any rope dict may carry: the type under either name, the base (read into rope_theta by the config).
_COMMON = frozenset({"rope_type", "type", "rope_theta"})
# Types whose original length defaults to max_position_embeddings, as transformers fills it in.
_WITH_ORIGINAL = ("yarn", "longrope", "llama3")


def check_scaling(scaling: dict | None, head_dim: int, max_position_embeddings: int,
                  original: int | None = None) -> dict | None:
    """The scaling dict in one form (rope_type set, `type` dropped, original_max_position_embeddings filled in),
    None for plain RoPE; ValueError naming what is not supported. `original`: a top-level
    original_max_position_embeddings in config.json, which transformers prefers over the dict's."""
    if not scaling:
        return None
    s = dict(scaling)
    kind = s.pop("type", None)
    kind = s.get("rope_type") or kind or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    s["rope_type"] = kind
    if s.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope partial_rotary_factor {s['partial_rotary_factor']} is not supported (the whole "
                         "head is rotated)")
    s.pop("partial_rotary_factor", None)
    if kind in _WITH_ORIGINAL:
        if original is not None:
            s["original_max_position_embeddings"] = original
        s.setdefault("original_max_position_embeddings", max_position_embeddings)
    required, optional = ROPE_TYPES[kind]
    missing = required - s.keys()
    if missing:
        raise ValueError(f"rope scaling {kind!r} needs {sorted(missing)}")
    unknown = s.keys() - required - optional - _COMMON
    if unknown:
        raise ValueError(f"rope scaling {kind!r}: field(s) {sorted(unknown)} not supported "
                         f"(it takes {sorted(required | optional)})")
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(s[name]) != head_dim // 2:
                raise ValueError(f"rope scaling longrope: {name} has {len(s[name])} values, the head needs "
                                 f"{head_dim // 2}")
    if kind == "default":
        return None
    return s


def max_context(scaling: dict | None, max_position_embeddings: int) -> int:
    """The longest max_model_len the scheme is meant for (vLLM's derived length, except yarn). linear and dynamic
    stretch max_position_embeddings by `factor`; yarn reaches original x factor (Qwen3's 32K x 4 = 128K, past its
    max_position_embeddings of 40,960); llama3 and longrope checkpoints already give the extended length."""
    kind = scaling["rope_type"] if scaling else "default"
    if kind in ("linear", "dynamic"):
        return int(max_position_embeddings * scaling["factor"])
    if kind == "yarn":
        factor = scaling["factor"] or max_position_embeddings / scaling["original_max_position_embeddings"]
        return max(max_position_embeddings, int(scaling["original_max_position_embeddings"] * factor))
    return max_position_embeddings


def default_max_len(scaling: dict | None, max_position_embeddings: int) -> int:
    """max_model_len when none is given: max_context, except longrope, which stays within its original length
    (its short factors) unless asked for more, as vLLM does."""
    if scaling and scaling["rope_type"] == "longrope":
        return min(max_position_embeddings, scaling["original_max_position_embeddings"])
    return max_context(scaling, max_position_embeddings)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int = 0,
                    max_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, attention factor cos/sin are multiplied by).
    `scaling` as check_scaling returns it; `max_len`: the length dynamic and longrope are fixed for."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta**exponents)
    kind = scaling["rope_type"] if scaling else "default"
    max_len = max_len or max_position_embeddings
    if kind == "default":
        return inv, 1.0
    if kind == "linear":  # positions divided by factor, i.e. every frequency
        return inv / scaling["factor"], 1.0
    if kind == "dynamic":
        # NTK: a larger base, by how far the length runs past max_position_embeddings. transformers computes it
        # from the length as a float32 tensor; so does this, to land on the same float32 frequencies.
        if max_len <= max_position_embeddings:
            return inv, 1.0  # no stretch: transformers' plain frequencies for any sequence this short
        length = torch.tensor(max_len)
        factor = scaling["factor"]
        stretch = (factor * length / max_position_embeddings) - (factor - 1)
        base = theta * stretch ** (head_dim / (head_dim - 2))
        return 1.0 / (base**exponents), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings, exponents)
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position_embeddings / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = scaling["long_factor"] if max_len > original else scaling["short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**exponents), float(attention)
    return _llama3(inv, scaling), 1.0


def _yarn(head_dim: int, theta: float, s: dict, max_position_embeddings: int, exponents: torch.Tensor):
    """YaRN: high frequencies (many turns within the original length) kept, low ones interpolated by `factor`, a
    linear ramp between the dims that turn beta_fast and beta_slow times; cos/sin scaled by the attention factor."""
    original = s["original_max_position_embeddings"]
    factor = s["factor"] or max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the dim index whose wavelength fits `turns` times in the original length
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolate), 0: divided by factor (interpolate)
    freq = theta**exponents
    inv = (1.0 / (factor * freq)) * (1 - keep) + (1.0 / freq) * keep
    return inv, float(attention)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
                 max_len: int | None = None):
        """`scaling` as check_scaling returns it; `max_len`: the engine's max_model_len (None: the scheme's
        default_max_len). The tables cover max(max_len, max_position_embeddings) positions."""
        super().__init__()
        max_len = max_len or default_max_len(scaling, max_position_embeddings)
        inv, attention = inv_frequencies(head_dim, theta, scaling, max_position_embeddings, max_len)
        freqs = torch.outer(torch.arange(max(max_len, max_position_embeddings), dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        # Kept in float32 and cast per call, as Hugging Face does, so bf16 rounding matches; the attention factor
        # multiplies them in float32 before that cast, as there.
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, D]; k [T, KVH, D]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
