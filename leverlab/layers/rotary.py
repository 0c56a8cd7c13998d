"""Rotary position embedding (the non-interleaved "rotate half" form), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        # Kept in float32 and cast per call, as Hugging Face does, so bf16 rounding matches.
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, D]; k [T, KVH, D]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
