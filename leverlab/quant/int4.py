"""Weight-only INT4, group-wise asymmetric: W ~= (q - z) * s, q and z in [0, 15], one (s, z) per `group_size`
input channels of each output row. Round-to-nearest at load time from a float checkpoint, or read from a
pre-quantized AWQ / GPTQ checkpoint (awq.py, gptq.py subclass this and only unpack their layouts).

Whatever the source, the loaded layer ends up in the same dense staging form - q [out, in] uint8,
s [out, in/g] float32, z [out, in/g] uint8 (integer zero points, as AWQ and GPTQ store them) -
(held under the checkpoint's names qweight / scales / qzeros while loading), which
process_weights_after_loading repacks for the kernel:
  CPU:  our streaming kernel (kernels/csrc/quant_linear.cpp, pack_int4_streaming: 4-bit q, fp16 s and z; with
        AVX-512 VNNI and out % 16 == 0 pack_int4_panels, the same bytes in panels of 16 rows) up to
        16 rows (integer dot products for bf16/fp16 activations); else aten._weight_int4pack_mm_for_cpu
        (eager), which Inductor lowers to its WoQ-int4 CPP GEMM template under max-autotune with frozen
        weights; scales_and_zeros [in/g, out, 2] in the activation dtype. Every path takes the scales as
        rounded to fp16.
  CUDA: aten._weight_int4pack_mm (tinygemm, bf16 activations). Written to its documented layout but not
        run here: no GPU on the development machines.
aten's two kernels compute (q - 8) * scale + zero per element, so our integer zero point z becomes the float
zero (8 - z) * s: exact in fp32, one rounding in bf16.
"""

from __future__ import annotations

import torch

from leverlab.quant import int8_gemm
from leverlab.quant.base import QuantMethod, flatten, set_param, shard_rows
from leverlab.quant.int8 import STREAMING_MAX_ROWS, streaming_kernels

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


def pack_int4_panels(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The panel layout of the AVX-512 VNNI kernel (csrc/quant_linear.cpp, int4_panels_q8): [out / 16, in / g,
    8 g + 64] uint8. Rows 16 p .. 16 p + 15 form panel p; per group, g / 8 vectors of 64 bytes, where bytes
    4 r .. 4 r + 3 of vector j hold row r's channels 8 j .. 8 j + 3 (low nibbles) and 8 j + 4 .. 8 j + 7 (high
    nibbles), then the 16 rows' fp16 scales and their 16 zero points. The same bytes as pack_int4_streaming's
    pair (4 + 32 / g bits per weight), in one stream. out % 16 == 0."""
    out, k = q.shape
    g, ng = group_size, k // group_size
    v = q.to(torch.uint8).reshape(out // 16, 16, ng, g // 8, 2, 4)
    nibbles = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(out // 16, ng, 8 * g)
    s16 = scales.float().clamp(max=torch.finfo(torch.float16).max).to(torch.float16)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [out, ng] fp16 -> [out / 16, ng, 32] bytes
        return t.reshape(out // 16, 16, ng).permute(0, 2, 1).contiguous().view(torch.uint8)

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
        packed = panels_to_rows(packed, (packed.shape[2] - 64) // 8)
    p = packed.view(out, -1, 16)
    q = torch.cat([p & 15, p >> 4], dim=2).view(out, ng, -1).float()
    s = scales.float()
    return ((q - s[:, 1, :, None]) * s[:, 0, :, None]).view(out, -1)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [out, in] weight that (q, scales, zeros) encode."""
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q.float() - z) * s


class Int4Method(QuantMethod):
    """Batched rows (CPU, bf16/fp16, `w8a8_min_rows` or more) take int8's int8 x int8 path (int8_gemm.py)
    over an int8 per-channel copy of the int4 weight: the int4 kernel is compute-bound by 16 rows (slower than
    bf16 there), and fbgemm's int8 GEMM is not. The copy costs 1 byte per weight of memory (int4 + copy
    ~1.56 B against bf16's 2) and is never read by single-stream decode; it requantizes the int4 weight (under
    half an int8 step per channel) and quantizes activations per row. `w8a8_min_rows = None` drops both."""

    name = "int4"
    checkpoint_format: str | None = None  # None: quantize a float checkpoint at load time
    w8a8_min_rows: int | None = 2  # batch 2+: the int4 kernel's cost grows with rows, fbgemm's barely

    def __init__(self, group_size: int = 64):
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.group_size = group_size
        # 4 bits + a 16-bit scale and a 16-bit zero point per group, as the streaming kernel stores them
        self.bits_per_weight = 4 + 32 / group_size

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> Int4Method:
        # `leverlab quantize --method int4` writes the AWQ layout: read it as AWQ.
        from leverlab.quant.awq import AWQMethod

        return AWQMethod.from_checkpoint_config(qcfg)

    def config_dict(self) -> dict:
        return {"quant_method": self.name, "bits": 4, "group_size": self.group_size}

    # ---- loading ---------------------------------------------------------------------------------
    def create_weights(self, layer) -> None:
        layer.params_dtype = layer.weight.dtype
        if layer.in_features % self.group_size:
            raise ValueError(f"{self.name}: in_features {layer.in_features} is not a multiple of the group size "
                             f"{self.group_size}; pick another group size")
        if self.checkpoint_format is None:
            return  # the float weight loads as usual and is quantized after loading
        dev, out, ng = layer.weight.device, layer.out_features, layer.in_features // self.group_size
        set_param(layer, "weight", None)
        # Dense staging, filled shard by shard from the checkpoint's packed tensors. They carry the checkpoint
        # tensors' names, so the loader's missing-weight check covers them; the shapes are ours (out-major).
        set_param(layer, "qweight", torch.zeros(out, layer.in_features, dtype=torch.uint8, device=dev))
        set_param(layer, "scales", torch.zeros(out, ng, dtype=torch.float32, device=dev))
        set_param(layer, "qzeros", torch.zeros(out, ng, dtype=torch.uint8, device=dev))
        layer.q_perm = None

    def load(self, layer, kind, tensor, shard) -> bool:
        if self.checkpoint_format is None:
            return False
        if kind == "bias" and layer.bias is None:
            # GPTQ exporters write all-zero biases for bias-free projections: harmless, so skipped.
            if torch.count_nonzero(tensor):
                raise ValueError(f"checkpoint has a non-zero bias for a layer without one ({shard})")
            return True
        if kind == "bias":
            return False
        self.load_packed(layer, kind, tensor, shard)
        return True

    def load_packed(self, layer, kind: str, tensor: torch.Tensor, shard: str | None) -> None:
        raise NotImplementedError

    def _stage(self, layer, name: str, rows: torch.Tensor, shard: str | None) -> None:
        """Copy [size, ...] rows (already unpacked, out-major) into the staging tensor `name`."""
        target = shard_rows(layer, getattr(layer, name).data, shard)
        if target.shape != rows.shape:
            raise ValueError(f"{self.name}: shape mismatch loading {name}/{shard}: unpacked checkpoint tensor "
                             f"{tuple(rows.shape)} vs layer {tuple(target.shape)} (group size {self.group_size}?)")
        target.copy_(rows)

    # ---- conversion ------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer) -> None:
        if self.checkpoint_format is None:
            q, s, z = quantize_int4(layer.weight.data, self.group_size)
            set_param(layer, "weight", None)
        else:
            q, s, z = layer.qweight.data, layer.scales.data, layer.qzeros.data
            if layer.q_perm is not None:  # GPTQ act-order: groups made contiguous by permuting inputs
                layer.q_perm = layer.q_perm.to(q.device)
                q = q[:, layer.q_perm]
            for name in ("scales", "qzeros"):
                delattr(layer, name)
        dtype = layer.params_dtype
        # Our streaming kernel (csrc/quant_linear.cpp) for up to 16 rows on the CPU, in its own layout: aten's
        # int4 kernel is compute-bound at a row (about half the rate our bf16 kernel reads at). Its scales are fp16,
        # and every other path below takes the same rounded values, so that a prompt (many rows) and its decode
        # (one) see one weight.
        packed, ss = pack_int4_streaming(q, s, z, self.group_size)
        layer.q4 = None
        kern = streaming_kernels(q.device)
        if kern is not None and getattr(layer, "q_perm", None) is None:
            layer.q4 = (packed, ss)
            if q.shape[0] % 16 == 0 and kern.has_fast_int6() and dtype in (torch.bfloat16, torch.float16):
                # AVX-512 VNNI: panels of 16 rows (one stream), where their integer path runs (bf16/fp16
                # activations; float32 ones would unpack them at every call)
                layer.q4 = (pack_int4_panels(q, s, z, self.group_size), ss)
            elif (self.group_size == 64 and q.shape[1] % 256 == 0 and kern.has_int4_interleaved()
                  and dtype in (torch.bfloat16, torch.float16)):
                # AVX2: each row's groups interleaved four at a time (the same bytes), which saves the kernel
                # its horizontal adds: the 0.6B shape's int4 body read 1.07-1.11x faster (session 37)
                layer.q4 = (pack_int4_interleaved(q), ss)
        layer.int8_key = None
        from leverlab.quant.int8 import quantize_int8, use_int8_gemm

        if self.w8a8_min_rows is not None and use_int8_gemm(layer, dtype, q.device):
            # the batched path's copy (see the class docstring)
            layer.int8_key = int8_gemm.pack(layer, *quantize_int8(dequantize_streaming(packed, ss)))
        if layer.q4 is not None and layer.int8_key is not None and self.w8a8_min_rows <= STREAMING_MAX_ROWS + 1:
            # Every row count has its kernel (streaming up to STREAMING_MAX_ROWS, then the int8 GEMM), so aten's
            # int4 layout would never be read: not building it saves 0.56 bytes per weight (int4 held ~2.1 bytes
            # per weight in all against bf16's 2).
            set_param(layer, "qweight", None)
            layer.scales_and_zeros = None
            return
        s16, z16 = ss[:, 0].float(), ss[:, 1].float()  # aten's weight: (q - 8) * s + (8 - z) * s
        sz = torch.stack([s16, (8.0 - z16) * s16], dim=-1).transpose(0, 1).contiguous().to(dtype)
        if q.device.type == "cuda":
            k = layer.in_features
            tiles = 8 if k % 256 == 0 else 4 if k % 128 == 0 else 2
            nibbles = (q[:, ::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        set_param(layer, "qweight", packed)
        set_param(layer, "scales_and_zeros", sz)  # [in/g, out, 2]

    def apply(self, layer, x: torch.Tensor, batched_path: bool = True) -> torch.Tensor:
        x2 = flatten(x)
        q4 = getattr(layer, "q4", None)
        if q4 is not None and batched_path and x2.shape[0] <= getattr(layer, "stream_rows", STREAMING_MAX_ROWS):
            y = streaming_kernels(x.device).int4_linear(x2, q4[0], q4[1], self.group_size, layer.bias)
            return y.view(*x.shape[:-1], layer.out_features)
        perm = getattr(layer, "q_perm", None)
        if perm is not None:  # GPTQ act-order: the weights' input channels are permuted (int8 copy included)
            x2 = x2[:, perm]
        sz = getattr(layer, "scales_and_zeros", None)
        if batched_path and getattr(layer, "int8_key", None) is not None and x2.shape[0] >= self.w8a8_min_rows:
            y = int8_gemm.int8_linear(x2, layer.int8_key, layer.out_features)
        elif sz is None:  # only the streaming layout was kept (no permutation then)
            y = streaming_kernels(x.device).int4_linear(x2, q4[0], q4[1], self.group_size, None)
        else:
            if x2.dtype != sz.dtype:
                x2 = x2.to(sz.dtype)
            if x.device.type == "cuda":
                y = torch.ops.aten._weight_int4pack_mm(x2, layer.qweight, self.group_size, sz)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.qweight, self.group_size, sz)
        y = y.to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def fused_weights(self, layer) -> tuple[int, list] | None:
        q4 = getattr(layer, "q4", None)
        return (2, [q4[0], q4[1], layer.bias]) if q4 is not None else None

    def bytes_read(self, layer, rows: int) -> int:
        bias = layer.bias.numel() * layer.bias.element_size() if layer.bias is not None else 0
        if getattr(layer, "q4", None) is not None and rows <= getattr(layer, "stream_rows", STREAMING_MAX_ROWS):
            return _streamed_bytes(layer.q4) + bias
        if getattr(layer, "int8_key", None) is not None and rows >= self.w8a8_min_rows:
            return layer.out_features * (layer.in_features + 4) + bias  # the packed int8 copy + fp32 scales
        if getattr(layer, "scales_and_zeros", None) is None:
            return _streamed_bytes(layer.q4) + bias
        return sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales_and_zeros)) + bias

    def dequantize(self, layer) -> torch.Tensor:
        if getattr(layer, "scales_and_zeros", None) is None:  # only the streaming layout: w = q * s - s * z
            return dequantize_streaming(*layer.q4)
        # Multiply the identity through the kernel: exactly the weight the kernel uses, [in, out] -> [out, in].
        eye = torch.eye(layer.in_features, dtype=layer.scales_and_zeros.dtype, device=layer.qweight.device)
        # With a GPTQ act-order permutation, apply() permutes the identity's columns, which puts the rows
        # of the result back in the checkpoint's input order.
        return self.apply(_NoBias(layer), eye, batched_path=False).float().t()

    # ---- export ----------------------------------------------------------------------------------
    def export(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from leverlab.quant.awq import pack_awq

        q, s, z = quantize_int4(weight, self.group_size)
        return pack_awq(q, s, z, scale_dtype=torch.float16)


def _streamed_bytes(q4: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes a streaming pass reads: panels carry their scales; the row layout reads its scales beside."""
    return q4[0].numel() if q4[0].dim() == 3 and not is_interleaved(q4[0]) else q4[0].numel() + q4[1].numel() * 2


class _NoBias:
    """A view of a layer without its bias, for dequantize()."""

    def __init__(self, layer):
        self.__dict__.update(qweight=layer.qweight, scales_and_zeros=layer.scales_and_zeros, bias=None,
                             out_features=layer.out_features, q_perm=getattr(layer, "q_perm", None))
