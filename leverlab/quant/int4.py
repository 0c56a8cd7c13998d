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
from leverlab.quant.base import STREAMING_MAX_ROWS, QuantMethod, flatten, set_param, shard_rows
from leverlab.quant.int8 import streaming_kernels, use_int8_gemm
from leverlab.quant.layouts import (
    INT4_GROUP_SIZES,
    dequantize_streaming,
    is_interleaved,
    pack_awq,
    pack_int4_interleaved,
    pack_int4_panels,
    pack_int4_streaming,
    quantize_int4,
    quantize_int8,
)


class Int4Method(QuantMethod):
    """Batched rows (CPU, bf16/fp16, `w8a8_min_rows` or more) take int8's int8 x int8 path (int8_gemm.py)
    over an int8 per-channel copy of the int4 weight: the int4 kernel is compute-bound by 16 rows (slower than
    bf16 there), and fbgemm's int8 GEMM is not. The copy costs 1 byte per weight of memory (int4 + copy
    ~1.56 B against bf16's 2) and is never read by single-stream decode; it requantizes the int4 weight (under
    half an int8 step per channel) and quantizes activations per row. `w8a8_min_rows = None` drops both."""

    name = "int4"
    checkpoint_format: str | None = None  # None: quantize a float checkpoint at load time
    w8a8_min_rows: int | None = 2  # batch 2+: the int4 kernel's cost grows with rows, fbgemm's barely
    # True: every zero point is 8 (GGUF Q4_0, quant/gguf.py), and the AVX-512 VNNI panels leave them out (8 g + 32
    # bytes a group instead of 8 g + 64: Q4_0's own 4.5 bits per weight at groups of 32, not 5)
    zero_point_free: bool = False

    def __init__(self, group_size: int = 64):
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.group_size = group_size
        # 4 bits + a 16-bit scale and a 16-bit zero point per group, as the streaming kernel stores them
        self.bits_per_weight = 4 + 32 / group_size

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
        layer.kernel_state.perm = None

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
        state = layer.kernel_state
        if self.checkpoint_format is None:
            q, s, z = quantize_int4(layer.weight.data, self.group_size)
            set_param(layer, "weight", None)
        else:
            q, s, z = layer.qweight.data, layer.scales.data, layer.qzeros.data
            if state.perm is not None:  # GPTQ act-order: groups made contiguous by permuting inputs
                state.perm = state.perm.to(q.device)
                q = q[:, state.perm]
            for name in ("scales", "qzeros"):
                delattr(layer, name)
        dtype = layer.params_dtype
        # Our streaming kernel (csrc/quant_linear.cpp) for up to 16 rows on the CPU, in its own layout: aten's
        # int4 kernel is compute-bound at a row (about half the rate our bf16 kernel reads at). Its scales are fp16,
        # and every other path below takes the same rounded values, so that a prompt (many rows) and its decode
        # (one) see one weight.
        packed, ss = pack_int4_streaming(q, s, z, self.group_size)
        state.stream = None
        kern = streaming_kernels(q.device)
        if kern is not None and state.perm is None:
            state.stream = (packed, ss)
            if q.shape[0] % 16 == 0 and kern.has_fast_int6() and dtype in (torch.bfloat16, torch.float16):
                # AVX-512 VNNI: panels of 16 rows (one stream), where their integer path runs (bf16/fp16
                # activations; float32 ones would unpack them at every call)
                state.stream = (pack_int4_panels(q, s, z, self.group_size, self.zero_point_free), ss)
            elif (self.group_size == 64 and q.shape[1] % 256 == 0 and kern.has_int4_interleaved()
                  and dtype in (torch.bfloat16, torch.float16)):
                # AVX2: each row's groups interleaved four at a time (the same bytes), which saves the kernel
                # its horizontal adds: the 0.6B shape's int4 body read 1.07-1.11x faster
                state.stream = (pack_int4_interleaved(q), ss)
        state.int8_key = None
        if self.w8a8_min_rows is not None and use_int8_gemm(layer, dtype, q.device):
            # the batched path's copy (see the class docstring)
            state.int8_key = int8_gemm.pack(layer, *quantize_int8(dequantize_streaming(packed, ss)))
        if state.stream is not None and state.int8_key is not None and self.w8a8_min_rows <= STREAMING_MAX_ROWS + 1:
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
        state = layer.kernel_state
        x2 = flatten(x)
        q4 = state.stream
        if q4 is not None and batched_path and x2.shape[0] <= state.stream_rows:
            y = streaming_kernels(x.device).int4_linear(x2, q4[0], q4[1], self.group_size, layer.bias)
            return y.view(*x.shape[:-1], layer.out_features)
        perm = state.perm
        if perm is not None:  # GPTQ act-order: the weights' input channels are permuted (int8 copy included)
            x2 = x2[:, perm]
        sz = layer.scales_and_zeros
        if batched_path and state.int8_key is not None and x2.shape[0] >= self.w8a8_min_rows:
            y = int8_gemm.int8_linear(x2, state.int8_key, layer.out_features)
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
        q4 = layer.kernel_state.stream
        return (2, [q4[0], q4[1], layer.bias]) if q4 is not None else None

    def bytes_read(self, layer, rows: int) -> int:
        bias = layer.bias.numel() * layer.bias.element_size() if layer.bias is not None else 0
        if layer.kernel_state.stream is not None and rows <= layer.kernel_state.stream_rows:
            return _streamed_bytes(layer.kernel_state.stream) + bias
        if layer.kernel_state.int8_key is not None and rows >= self.w8a8_min_rows:
            return layer.out_features * (layer.in_features + 4) + bias  # the packed int8 copy + fp32 scales
        if layer.scales_and_zeros is None:
            return _streamed_bytes(layer.kernel_state.stream) + bias
        return sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales_and_zeros)) + bias

    def dequantize(self, layer) -> torch.Tensor:
        if layer.scales_and_zeros is None:  # only the streaming layout: w = q * s - s * z
            return dequantize_streaming(*layer.kernel_state.stream)
        # Multiply the identity through the kernel: exactly the weight the kernel uses, [in, out] -> [out, in].
        eye = torch.eye(layer.in_features, dtype=layer.scales_and_zeros.dtype, device=layer.qweight.device)
        # With a GPTQ act-order permutation, apply() permutes the identity's columns, which puts the rows
        # of the result back in the checkpoint's input order.
        return self.apply(_NoBias(layer), eye, batched_path=False).float().t()

    # ---- export ----------------------------------------------------------------------------------
    def export(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s, z = quantize_int4(weight, self.group_size)
        return pack_awq(q, s, z, scale_dtype=torch.float16)


def _streamed_bytes(q4: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes a streaming pass reads: panels carry their scales; the row layout reads its scales beside."""
    return q4[0].numel() if q4[0].dim() == 3 and not is_interleaved(q4[0]) else q4[0].numel() + q4[1].numel() * 2


class _NoBias:
    """A view of a layer without its bias, for dequantize()."""

    def __init__(self, layer):
        self.__dict__.update(qweight=layer.qweight, scales_and_zeros=layer.scales_and_zeros, bias=None,
                             out_features=layer.out_features, kernel_state=layer.kernel_state)
