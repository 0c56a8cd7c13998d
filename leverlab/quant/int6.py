"""INT6, group-wise asymmetric: W ~= (q - z) * s, q and z in [0, 63], one fp16 (s, z) per `group_size` inputs.

What it is for: an int4 model's output head. The tied head of a small model is a large share of a decode step's
bytes (a quarter of Qwen3-0.6B in bf16, over a third of its int4 step with an int8 head), and its logits are the
most precision-sensitive output, so llama.cpp's Q4_0 files keep it in Q6_K (6.56 bits per weight). This is our
6-bit step: 6 + 32/g bits per weight (6.5 at g = 64), quantized at load time by round-to-nearest.

Kernels (kernels/csrc/quant_linear.cpp, int6_linear): per 128 weights, 64 bytes of low nibbles in int4's layout
(pack_int4_streaming) and 32 of high 2 bits, side by side, so that one decode pass reads each row front to back.
bf16/fp16 activations (quantized per 64, as int4's with groups of 64) up to 16 rows take the int4 kernel's
AVX-512 VNNI loops with a load and four ops more per 128 weights (has_fast_int6; rows in sixteens as panels,
pack_int6_panels). On AVX2 without those, a single row with groups of 64 takes the int4 kernel's AVX2 single
stream with the high bits merged in (has_int6_stream; several rows run it once per row, so the loader's timing
gives them the int8 copy below), over interleaved rows where the width is whole 256-channel steps
(pack_int6_interleaved, as int4's). Elsewhere, and for float32 activations, a plain loop that is exact against the
dequantized weight. More rows take fbgemm's int8 GEMM over an int8 copy, as int4 does (int8_gemm.py). No GPU
kernel: on other devices the weight is held dequantized (unmeasured).
"""

from __future__ import annotations

import torch

from leverlab.errors import UnsupportedLever
from leverlab.quant import int8_gemm
from leverlab.quant.base import QuantMethod, flatten, set_param
from leverlab.quant.int4 import (
    INT4_GROUP_SIZES,
    interleaved_lanes,
    lanes_to_channels,
    pack_int4_interleaved,
    pack_int4_panels,
    pack_int4_streaming,
    quantize_groups,
)
from leverlab.quant.int8 import STREAMING_MAX_ROWS, quantize_int8, streaming_kernels, use_int8_gemm

QUAD = 128  # weights per quad: the kernel's step, and the high-bit plane's unit (32 bytes)


def quantize_int6(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_groups at 6 bits: q and z in 0..63."""
    return quantize_groups(w, group_size, 6)


def pack_int6_streaming(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [out, 3 in/4] uint8, [out, 2, in/g] fp16 s then z). A row is a run of 96-byte quads, one per 128
    weights, so that the kernel reads it front to back as one stream: the quad's low nibbles in int4's layout
    (64 bytes: pack_int4_streaming), then its high 2 bits (32 bytes). In a quad, lane p = 16 j + i (block j,
    i < 16) of the kernel's low-nibble vector holds weight 32 j + i, of its high-nibble vector weight 32 j + 16 + i;
    the plane's byte t holds the high bits of low lanes t and 32 + t (bits 0-1, 2-3) and of high lanes t and
    32 + t (bits 4-5, 6-7)."""
    out, k = q.shape
    if k % QUAD:
        raise ValueError(f"int6: in_features {k} is not a multiple of {QUAD}")
    q = q.to(torch.uint8)
    nibbles, ss = pack_int4_streaming(q & 15, scales, zeros, group_size)
    h = (q >> 4).reshape(out, k // QUAD, 4, 2, 16)  # [row, quad, block j, half, i]
    lo, hi = h[:, :, :, 0].reshape(out, -1, 64), h[:, :, :, 1].reshape(out, -1, 64)  # lanes p = 16 j + i
    plane = lo[..., :32] | (lo[..., 32:] << 2) | (hi[..., :32] << 4) | (hi[..., 32:] << 6)
    quads = torch.cat([nibbles.reshape(out, k // QUAD, 64), plane], dim=2)  # [row, quad, 96]
    return quads.reshape(out, 3 * k // 4).contiguous(), ss


def pack_int6_panels(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The panel layout of the AVX-512 VNNI kernel (csrc/quant_linear.cpp, int4_panels_q8 with SIX): [out / 16,
    in / g, 12 g + 64] uint8. As pack_int4_panels for the low 4 bits, each 64-byte vector followed by 32 bytes of
    high 2 bits: byte t holds those of the low-nibble weights at bytes t and 32 + t (bits 0-1, 4-5) and of the
    high-nibble ones (bits 2-3, 6-7); then the group's 16 fp16 scales and 16 zero points. out % 16 == 0."""
    out, k = q.shape
    g, ng = group_size, k // group_size
    q = q.to(torch.uint8)
    nib = pack_int4_panels(q & 15, scales, zeros, g)
    vec = nib[:, :, : 8 * g].reshape(out // 16, ng, g // 8, 64)
    h = (q >> 4).reshape(out // 16, 16, ng, g // 8, 2, 4).permute(0, 2, 3, 4, 1, 5).reshape(out // 16, ng, g // 8, 2, 64)
    lo, hi = h[..., 0, :], h[..., 1, :]  # the high bits of the vector's low-nibble and high-nibble weights, by byte
    plane = lo[..., :32] | (hi[..., :32] << 2) | (lo[..., 32:] << 4) | (hi[..., 32:] << 6)
    weights = torch.cat([vec, plane], dim=3).reshape(out // 16, ng, 12 * g)
    return torch.cat([weights, nib[:, :, 8 * g :]], dim=2).contiguous()


def pack_int6_interleaved(q: torch.Tensor) -> torch.Tensor:
    """The AVX2 kernel's layout for groups of 64, as int4's (pack_int4_interleaved): [out, in / 256, 192] uint8.
    Per 256 channels two 96-byte units, each two of int4's interleaved vectors of low nibbles (2u, 2u + 1), then
    32 bytes of their high 2 bits: byte t holds those of vector 2u's low and high nibble at t (bits 0-1, 4-5) and
    of vector 2u + 1's (bits 2-3, 6-7), the plane order of pack_int6_streaming's quads, so that the kernel
    unpacks a unit as it unpacks a quad. in % 256 == 0."""
    out, k = q.shape
    q = q.to(torch.uint8)
    vec = pack_int4_interleaved(q & 15).reshape(out, k // 256, 2, 64)
    h = interleaved_lanes(q >> 4)  # [out, s, v, j, nibble]
    lo, hi = h[..., 0].reshape(out, k // 256, 2, 2, 32), h[..., 1].reshape(out, k // 256, 2, 2, 32)  # [.., u, v % 2, j]
    plane = lo[:, :, :, 0] | (lo[:, :, :, 1] << 2) | (hi[:, :, :, 0] << 4) | (hi[:, :, :, 1] << 6)
    return torch.cat([vec, plane], dim=3).reshape(out, k // 256, 192).contiguous()


def int6_interleaved_to_q(il: torch.Tensor) -> torch.Tensor:
    """q uint8 [out, in] from pack_int6_interleaved's bytes."""
    out, steps, _ = il.shape
    units = il.reshape(out, steps, 2, 96)
    vec, plane = units[..., :64].reshape(out, steps, 2, 2, 32), units[..., 64:]  # [.., u, v % 2, j], [.., u, j]
    f = [(plane >> s) & 3 for s in (0, 2, 4, 6)]  # vector 2u low, 2u + 1 low, 2u high, 2u + 1 high
    low = torch.stack([vec & 15, vec >> 4], dim=-1)  # [.., u, v % 2, j, nibble]
    high = torch.stack([torch.stack([f[0], f[2]], dim=-1), torch.stack([f[1], f[3]], dim=-1)], dim=3)
    return lanes_to_channels((low | (high << 4)).reshape(out, steps, 4, 32, 2))


def is_interleaved(packed: torch.Tensor) -> bool:
    """Whether an int6 streaming weight is pack_int6_interleaved's (3-D, 192 bytes a step) rather than panels."""
    return packed.dim() == 3 and packed.shape[2] == 192


def int6_panels_to_q(panels: torch.Tensor, group_size: int) -> torch.Tensor:
    """q uint8 [out, in] from pack_int6_panels' bytes."""
    npan, ng, _ = panels.shape
    g = group_size
    vec = panels[:, :, : 12 * g].reshape(npan, ng, g // 8, 96)
    nib, plane = vec[..., :64].reshape(npan, ng, g // 8, 16, 4), vec[..., 64:]
    low = torch.stack([nib & 15, nib >> 4], dim=3)  # [panel, group, vector, half, row, t]
    f = [(plane >> s) & 3 for s in (0, 2, 4, 6)]  # lo bytes < 32, hi bytes < 32, lo bytes >= 32, hi bytes >= 32
    high = torch.stack([torch.cat([f[0], f[2]], dim=3), torch.cat([f[1], f[3]], dim=3)], dim=3)
    q = low | (high.reshape(npan, ng, g // 8, 2, 16, 4) << 4)
    return q.permute(0, 4, 1, 2, 3, 5).reshape(npan * 16, ng * g)


def unpack_int6_streaming(packed: torch.Tensor) -> torch.Tensor:
    """q uint8 [out, in] from pack_int6_streaming's rows (or pack_int6_panels' panels, or
    pack_int6_interleaved's rows)."""
    if is_interleaved(packed):
        return int6_interleaved_to_q(packed)
    if packed.dim() == 3:
        return int6_panels_to_q(packed, (packed.shape[2] - 64) // 12)
    out, k = packed.shape[0], packed.shape[1] * 4 // 3
    quads = packed.reshape(out, k // QUAD, 96)
    p = quads[..., :64].reshape(out, k // 32, 16)
    low = torch.cat([p & 15, p >> 4], dim=2).reshape(out, k // QUAD, 4, 2, 16)
    plane = quads[..., 64:]
    lanes = [(plane >> s) & 3 for s in (0, 2, 4, 6)]  # low lanes t, 32 + t; high lanes t, 32 + t
    lo = torch.cat(lanes[:2], dim=2).reshape(out, k // QUAD, 4, 16)
    hi = torch.cat(lanes[2:], dim=2).reshape(out, k // QUAD, 4, 16)
    return (low | (torch.stack([lo, hi], dim=3) << 4)).reshape(out, k)


def dequantize_int6_streaming(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] weight that pack_int6_streaming's (packed, scales) encode: (q - z) * s. packed may be
    panels (pack_int6_panels) or interleaved rows (pack_int6_interleaved)."""
    q = unpack_int6_streaming(packed).float()
    out, ng = scales.shape[0], scales.shape[2]
    s = scales.float()
    return ((q.view(out, ng, -1) - s[:, 1, :, None]) * s[:, 0, :, None]).view(out, -1)


class Int6Method(QuantMethod):
    name = "int6"
    w8a8_min_rows = 2  # past the streaming rows, fbgemm's int8 GEMM over an int8 copy (autotune.py times both)

    def __init__(self, group_size: int = 64):
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int6 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.group_size = group_size
        self.bits_per_weight = 6 + 32 / group_size

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> Int6Method:
        raise UnsupportedLever("int6 has no checkpoint format: quantize at load time (--quantization int6, or "
                               "--lm-head-quantization int6)")

    def config_dict(self) -> dict:
        return {"quant_method": self.name, "bits": 6, "group_size": self.group_size}

    def create_weights(self, layer) -> None:
        layer.params_dtype = layer.weight.dtype
        if layer.in_features % QUAD or layer.in_features % self.group_size:
            raise ValueError(f"int6: in_features {layer.in_features} must be a multiple of {QUAD} and of the "
                             f"group size {self.group_size}")

    def process_weights_after_loading(self, layer) -> None:
        q, s, z = quantize_int6(layer.weight.data, self.group_size)
        packed, ss = pack_int6_streaming(q, s, z, self.group_size)
        dev = layer.weight.device
        set_param(layer, "weight", None)
        kern = streaming_kernels(dev)
        layer.q6 = (packed, ss) if kern is not None else None
        if (kern is not None and kern.has_fast_int6() and layer.out_features % 16 == 0
                and layer.params_dtype in (torch.bfloat16, torch.float16)):  # panels of 16 rows, as int4's
            layer.q6 = (pack_int6_panels(q, s, z, self.group_size), ss)
        elif (kern is not None and kern.has_int4_interleaved() and self.group_size == 64
              and layer.in_features % 256 == 0 and layer.params_dtype in (torch.bfloat16, torch.float16)):
            layer.q6 = (pack_int6_interleaved(q), ss)  # AVX2: groups interleaved four at a time, as int4's
        layer.int8_key = None
        layer.dense = None
        if use_int8_gemm(layer, layer.params_dtype, dev):  # the batched rows' copy (Int4Method's docstring)
            layer.int8_key = int8_gemm.pack(layer, *quantize_int8(dequantize_int6_streaming(packed, ss)))
        if layer.q6 is None:  # no kernel of ours here: the weight dequantized, in the model dtype
            layer.dense = dequantize_int6_streaming(packed, ss).to(layer.params_dtype)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        x2 = flatten(x)
        rows = x2.shape[0]
        if layer.q6 is not None and rows <= getattr(layer, "stream_rows", STREAMING_MAX_ROWS):
            y = streaming_kernels(x.device).int6_linear(x2, *layer.q6, self.group_size, layer.bias)
            return y.view(*x.shape[:-1], layer.out_features)
        if layer.int8_key is not None and rows >= self.w8a8_min_rows:
            y = int8_gemm.int8_linear(x2, layer.int8_key, layer.out_features).to(x.dtype)
        elif layer.q6 is not None:
            y = streaming_kernels(x.device).int6_linear(x2, *layer.q6, self.group_size, None)
        else:
            y = x2 @ layer.dense.t().to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def fused_weights(self, layer) -> tuple[int, list] | None:
        return (4, [*layer.q6, layer.bias]) if layer.q6 is not None else None  # fused_decoder.cpp: kind 4

    def dequantize(self, layer) -> torch.Tensor:
        if layer.q6 is None:
            return layer.dense.float()
        return dequantize_int6_streaming(*layer.q6)

    def bytes_read(self, layer, rows: int) -> int:
        bias = layer.bias.numel() * layer.bias.element_size() if layer.bias is not None else 0
        panels = layer.q6 is not None and layer.q6[0].dim() == 3 and not is_interleaved(layer.q6[0])
        streamed = layer.q6[0].numel() + (0 if panels else layer.q6[1].numel() * 2) \
            if layer.q6 is not None else 0  # (panels carry their scales)
        if layer.q6 is not None and rows <= getattr(layer, "stream_rows", STREAMING_MAX_ROWS):
            return streamed + bias
        if layer.int8_key is not None and rows >= self.w8a8_min_rows:
            return layer.out_features * (layer.in_features + 4) + bias
        if layer.q6 is not None:
            return streamed + bias
        return layer.dense.numel() * layer.dense.element_size() + bias
