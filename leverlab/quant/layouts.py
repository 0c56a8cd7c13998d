"""Every weight layout of the quantization methods, in one place: quantizers, the packers into our kernels'
layouts (kernels/csrc/quant_linear.cpp: rows, AVX-512 VNNI panels of 16 rows, AVX2 groups interleaved four at
a time), the checkpoint formats' nibble packings (AWQ, GPTQ), and the inverses the tests and dequantize() use.

Plain tensor functions, no layers and no kernels: the methods (int8.py, int4.py, int6.py, awq.py, gptq.py) import
them from here and never from each other's files.
"""

from __future__ import annotations

import torch

# ---- int8 ------------------------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in], scales float32 [out]), per-channel symmetric round-to-nearest.
    absmax: each row's max |w| where w is a slice of longer rows (a tensor-parallel rank's), None: w's own."""
    w = w.float()
    scales = ((w.abs().amax(dim=1) if absmax is None else absmax) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def pack_int8_panels(q: torch.Tensor) -> torch.Tensor:
    """The panel layout of the AVX-512 VNNI kernel (csrc/quant_linear.cpp, int8_panels_q8): [out / 16, in / 32,
    512] uint8. Rows 16 p .. 16 p + 15 form panel p; per 32-channel block, 8 vectors of 64 bytes, where bytes
    4 r .. 4 r + 3 of vector j hold row r's channels 4 j .. 4 j + 3, each as q + 128. out % 16 == in % 32 == 0."""
    out, k = q.shape
    v = (q.to(torch.int16) + 128).to(torch.uint8).reshape(out // 16, 16, k // 32, 8, 4)
    return v.permute(0, 2, 3, 1, 4).reshape(out // 16, k // 32, 512).contiguous()


def int8_panels_to_rows(panels: torch.Tensor) -> torch.Tensor:
    """pack_int8_panels' weight as rows ([out, in] int8)."""
    npan, nb, _ = panels.shape
    v = panels.reshape(npan, nb, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(npan * 16, nb * 32)
    return (v.to(torch.int16) - 128).to(torch.int8)


# ---- int4 (and the groups int6 shares) -------------------------------------------------------------------


INT4_GROUP_SIZES = (32, 64, 128, 256)


def quantize_groups(w: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> q uint8 [out, in] (0 .. 2^bits - 1), scales float32 [out, in/g], zeros uint8 [out, in/g].
    Asymmetric min/max round-to-nearest with integer zero points (AutoAWQ's RTN, without its scale search)."""
    top = float(2**bits - 1)
    out, k = w.shape
    g = w.float().reshape(out, k // group_size, group_size)
    wmax, wmin = g.amax(dim=-1), g.amin(dim=-1)
    scales = ((wmax - wmin) / top).clamp(min=1e-8)
    zeros = torch.round(-wmin / scales).clamp(0, top)
    q = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp(0, top)
    return q.reshape(out, k).to(torch.uint8), scales, zeros.to(torch.uint8)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_groups at 4 bits: q and z in 0..15."""
    return quantize_groups(w, group_size, 4)


def pack_int4_streaming(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The streaming kernel's layout: (packed [out, in/2] uint8, [out, 2, in/g] fp16: each row's s, then its z).
    Per 32-weight block, byte i holds weight i (low nibble) and weight 16 + i (high nibble). fp16 keeps the step
    at 4 + 32/g bits per weight (4.5 at g = 64, as Q4_0). The zero points are exact in fp16 and so are the
    scales of AWQ / GPTQ checkpoints (stored in fp16): those load bit for bit; RTN's float32 scales round once,
    by at most 2^-11 of themselves."""
    out, k = q.shape
    blocks = q.to(torch.uint8).reshape(out, k // 32, 2, 16)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, k // 2).contiguous()
    s16 = scales.float().clamp(max=torch.finfo(torch.float16).max).to(torch.float16)
    return packed, torch.stack([s16, zeros.to(torch.float16)], dim=1).contiguous()


def pack_int4_panels(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     symmetric: bool = False) -> torch.Tensor:
    """The panel layout of the AVX-512 VNNI kernel (csrc/quant_linear.cpp, int4_panels_q8): [out / 16, in / g,
    8 g + 64] uint8. Rows 16 p .. 16 p + 15 form panel p; per group, g / 8 vectors of 64 bytes, where bytes
    4 r .. 4 r + 3 of vector j hold row r's channels 8 j .. 8 j + 3 (low nibbles) and 8 j + 4 .. 8 j + 7 (high
    nibbles), then the 16 rows' fp16 scales and their 16 zero points. The same bytes as pack_int4_streaming's
    pair (4 + 32 / g bits per weight), in one stream. out % 16 == 0.
    symmetric: every zero point is 8 (llama.cpp's Q4_0) and none is stored: 8 g + 32 bytes a group, 4 + 16 / g bits
    per weight (the kernel tells the two forms apart by that size)."""
    out, k = q.shape
    g, ng = group_size, k // group_size
    v = q.to(torch.uint8).reshape(out // 16, 16, ng, g // 8, 2, 4)
    nibbles = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(out // 16, ng, 8 * g)
    s16 = scales.float().clamp(max=torch.finfo(torch.float16).max).to(torch.float16)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [out, ng] fp16 -> [out / 16, ng, 32] bytes
        return t.reshape(out // 16, 16, ng).permute(0, 2, 1).contiguous().view(torch.uint8)

    if symmetric:
        if not bool((zeros == 8).all()):
            raise ValueError("symmetric int4 panels need every zero point to be 8")
        return torch.cat([nibbles, per_group(s16)], dim=2).contiguous()
    return torch.cat([nibbles, per_group(s16), per_group(zeros.to(torch.float16))], dim=2).contiguous()


def panels_to_rows(panels: torch.Tensor, group_size: int) -> torch.Tensor:
    """pack_int4_panels' weights in pack_int4_streaming's row layout ([out, in / 2] uint8)."""
    npan, ng, _ = panels.shape
    g = group_size
    v = panels[:, :, : 8 * g].reshape(npan, ng, g // 8, 16, 4)
    q = torch.stack([v & 15, v >> 4], dim=4).permute(0, 3, 1, 2, 4, 5).reshape(npan * 16, ng * g)
    blocks = q.reshape(npan * 16, -1, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(npan * 16, -1).contiguous()


def interleaved_lanes(t: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out, in / 256, 4, 32, 2]: where pack_int4_interleaved puts each channel, per 256 channels
    vector v, byte j, nibble (low, high). Channel 256 s + 64 g + 32 nibble + 8 v + 4 h + t sits at byte
    j = 16 h + 4 g + t of vector v. in % 256 == 0."""
    out, k = t.shape
    v = t.reshape(out, k // 256, 4, 2, 4, 2, 4).permute(0, 1, 4, 5, 2, 6, 3)  # [out, s, v, h, g, t, nibble]
    return v.reshape(out, k // 256, 4, 32, 2)


def lanes_to_channels(lanes: torch.Tensor) -> torch.Tensor:
    """interleaved_lanes' inverse: [out, steps, 4, 32, 2] -> [out, 256 steps]."""
    out, steps = lanes.shape[:2]
    v = lanes.reshape(out, steps, 4, 2, 4, 4, 2)  # [out, s, v, h, g, t, nibble]
    return v.permute(0, 1, 4, 6, 2, 3, 5).reshape(out, steps * 256)


def pack_int4_interleaved(q: torch.Tensor) -> torch.Tensor:
    """The AVX2 kernel's layout for groups of 64 (csrc/quant_linear.cpp, u4_row_g64x4's IL): [out, in / 256, 128]
    uint8, the row layout's bytes in another order, so that a row stays one stream and its scales stay beside
    ([out, 2, in / 64], as pack_int4_streaming's). Per 256 input channels (four groups), four 32-byte vectors:
    byte j of vector k holds group (j // 4) % 4's channel 8 k + 4 (j // 16) + j % 4 in its low nibble and that
    channel + 32 in its high one (interleaved_lanes), so that an integer dot product's lanes are already per group
    and the four groups' sums add with no horizontal step. in % 256 == 0."""
    lanes = interleaved_lanes(q.to(torch.uint8))
    return (lanes[..., 0] | (lanes[..., 1] << 4)).reshape(q.shape[0], -1, 128).contiguous()


def interleaved_to_rows(il: torch.Tensor) -> torch.Tensor:
    """pack_int4_interleaved's weights in pack_int4_streaming's row layout ([out, in / 2] uint8)."""
    b = il.reshape(il.shape[0], il.shape[1], 4, 32)
    q = lanes_to_channels(torch.stack([b & 15, b >> 4], dim=-1))
    blocks = q.reshape(q.shape[0], -1, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def panel_group_size(panels: torch.Tensor) -> int:
    """The group size of pack_int4_panels' panels, either form: 8 g + 64 bytes a group, or 8 g + 32 symmetric
    (g a multiple of 32, so 8 g is one of 256: the two never meet)."""
    b = panels.shape[2]
    return (b - 64) // 8 if (b - 64) % 256 == 0 else (b - 32) // 8


def is_interleaved(packed: torch.Tensor) -> bool:
    """Whether a streaming weight is pack_int4_interleaved's (3-D, 128 bytes a step) rather than panels."""
    return packed.dim() == 3 and packed.shape[2] == 128


def dequantize_streaming(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] weight that pack_int4_streaming's (packed, scales) encode: (q - z) * s. packed may
    be panels (pack_int4_panels) or interleaved rows (pack_int4_interleaved)."""
    out, ng = scales.shape[0], scales.shape[2]
    if is_interleaved(packed):
        packed = interleaved_to_rows(packed)
    elif packed.dim() == 3:
        packed = panels_to_rows(packed, panel_group_size(packed))
    p = packed.view(out, -1, 16)
    q = torch.cat([p & 15, p >> 4], dim=2).view(out, ng, -1).float()
    s = scales.float()
    return ((q - s[:, 1, :, None]) * s[:, 0, :, None]).view(out, -1)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [out, in] weight that (q, scales, zeros) encode."""
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q.float() - z) * s


# ---- int6 ------------------------------------------------------------------------------------------------


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


def is_int6_interleaved(packed: torch.Tensor) -> bool:
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
    if is_int6_interleaved(packed):
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


# ---- AWQ checkpoints -------------------------------------------------------------------------------------


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8


AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]


_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [r, c/8] -> uint8 [r, c]: 8 nibbles per int32 along the last dim, optionally reordered."""
    nib = (packed.to(torch.int32)[..., None] >> _SHIFTS.to(packed.device)) & 0xF  # [r, c/8, 8] in nibble order
    if order is not None:
        nib = nib[..., list(order)]
    return nib.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_cols(vals: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """uint8 [r, c] (0..15) -> int32 [r, c/8], the inverse of unpack_cols (with the inverse order)."""
    r, c = vals.shape
    v = vals.to(torch.int64).reshape(r, c // 8, 8)
    if order is not None:
        v = v[..., list(order)]  # nibble i <- column order[i]
    word = (v << _SHIFTS.to(torch.int64).to(vals.device)).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, scale_dtype=torch.float16) -> dict:
    """Our out-major (q [out, in], scales/zeros [out, in/g]) -> the AWQ GEMM checkpoint tensors."""
    return {
        "qweight": pack_cols(q.t().contiguous(), AWQ_ORDER),
        "qzeros": pack_cols(zeros.t().contiguous(), AWQ_ORDER),
        "scales": scales.t().contiguous().to(scale_dtype),
    }


# ---- GPTQ checkpoints ------------------------------------------------------------------------------------


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r/8, c] -> uint8 [r, c], nibble j of packed[r] being row 8r + j."""
    nib = (packed.to(torch.int32)[:, None, :] >> _SHIFTS.to(packed.device)[None, :, None]) & 0xF  # [r/8, 8, c]
    return nib.reshape(-1, packed.shape[1]).to(torch.uint8)


# ---- GGUF blocks (llama.cpp's Q8_0 and Q4_0) -------------------------------------------------------------


GGUF_BLOCK = 32  # weights per Q8_0 / Q4_0 block, along a row (input channels)


def unpack_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 tensor's rows (uint8 [out, in / 32 * 34]: per block an fp16 scale d, then 32 int8 q) ->
    (q int8 [out, in], d float32 [out, in / 32]); W = d * q, exact in float32 (11 by 8 significant bits)."""
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(out, -1).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(out, -1)
    return q, d


def unpack_q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_0 tensor's rows (uint8 [out, in / 32 * 18]: per block an fp16 scale d, then 16 bytes whose byte
    i holds weight i in its low nibble and weight 16 + i in its high one) -> quantize_groups' form at groups of
    32: q uint8 [out, in] in 0..15, scales float32 [out, in / 32] = d, zeros uint8 = 8. W = d * (q - 8), which
    is int4's (q - z) * s with z = 8 exactly, and d is already the fp16 our streaming layout keeps: no rounding.
    (The nibble order is pack_int4_streaming's too; the staging form is unpacked so that every int4 layout,
    panels included, packs from it.)"""
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, 18)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(out, -1).float()
    nib = blocks[..., 2:]
    q = torch.cat([nib & 15, nib >> 4], dim=2).reshape(out, -1)
    return q, d, torch.full_like(d, 8, dtype=torch.uint8)
