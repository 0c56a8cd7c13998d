"""The layer methods behind a compressed-tensors checkpoint (compressed_tensors.py reads the config and picks one
per layer): each takes the checkpoint's tensors under their own names, puts them into an existing method's
staging form without requantizing, and from there that method's kernels run them.

  CTInt8Method   int-quantized / naive-quantized int8, per-channel symmetric weights (W8A8 or W8A16): the int8
                 values and scales go straight into int8.py's layout (qweight [out, in], scales [out] float32).
  CTInt4Method   pack-quantized int4, group-wise, symmetric or with zero points (W4A16): unpacked by the
                 compressed-tensors package's own unpack_from_int32, shifted from its signed range (-8..7) to
                 int4.py's unsigned one (0..15) - W = (q - z) s is the same number - and repacked for our kernels.
  CTFP8Method    float-quantized e4m3 weights, per channel, per tensor or per block (weight_block_size): stored as
                 e4m3 and widened in the matmul on the CPU, as fp8.py does.

Activations: W8A8's format quantizes them per token, symmetric, at run time (scale max|x| / 127.5, round half to
even, clamp to -128..127). In float32 (the fidelity path) apply() does exactly that before int8.py's float matmul.
In bf16/fp16 our int8 kernels quantize them themselves: per 32-element block up to 16 rows (finer than per
token), per row (= per token) in the int8 GEMM beyond. FP8's activation quantization is a GPU matter (fp8.py):
the CPU multiplies float activations by the widened weight.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

from leverlab.quant.base import TensorLayout, copy_checked, flatten, set_param, shard_rows
from leverlab.quant.fp8_checkpoint import FP8CheckpointMethod, check_zero_points
from leverlab.quant.int4 import Int4Method
from leverlab.quant.int8 import Int8Method

# The tensor the format writes with every packed weight: its [out, in] shape (the slice's own rows and
# inputs are the layer's, so it is only checked where the whole tensor is here).
SHAPE = "weight_shape"


def quantize_tokens_int8(x: torch.Tensor) -> torch.Tensor:
    """x float [rows, in] -> x quantized per row to int8 and back (dynamic, symmetric: the format's own rule)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return torch.round(x / scale).clamp(-128, 127) * scale


class CTInt8Method(Int8Method):
    """int8 per-channel weights under the format's names: `weight` int8 [out, in] (int-quantized) or
    `weight_packed` int32 [out, in/4] with `weight_shape` (pack-quantized, as W8A16 releases are written), and
    `weight_scale` [out, 1]."""

    def __init__(self, activations: bool, packed: bool = False):
        # W8A8: our int8 (activations quantized in every kernel); W8A16: weight-only (never the int8 x int8 path)
        super().__init__(checkpoint=True, w8a8_min_rows=1 if activations else None)
        self.name = "int8" if activations else "int8-woq"
        self.packed = packed
        self.wname = "weight_packed" if packed else "weight"

    def create_weights(self, layer) -> None:
        layer.params_dtype = layer.weight.dtype
        dev = layer.weight.device
        set_param(layer, "weight", None)
        set_param(layer, self.wname, torch.zeros(layer.out_features, layer.in_features, dtype=torch.int8, device=dev))
        set_param(layer, "weight_scale", torch.zeros(layer.out_features, 1, dtype=torch.float32, device=dev))

    def load(self, layer, kind, tensor, shard) -> bool:
        if kind == SHAPE and self.packed:
            return True  # the layer knows its shape (and a tensor-parallel slice is not the whole one)
        if kind == self.wname:
            target = shard_rows(layer, getattr(layer, kind).data, shard)
            if self.packed:
                tensor = unpack_from_int32(tensor, 8, target.shape)
            elif tensor.dtype != torch.int8:
                raise ValueError(f"compressed-tensors int8 layer: weight/{shard} is {tensor.dtype}, not int8")
            copy_checked(target, tensor, f"{kind}/{shard}")
            return True
        if kind == "weight_scale":
            copy_checked(shard_rows(layer, layer.weight_scale.data, shard), tensor.float().reshape(-1, 1),
                         f"{kind}/{shard}")
            return True
        if kind == "weight_zero_point":
            check_zero_points(tensor, f"int8 layer {shard or ''}")
            return True
        return False

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        return {"weight": TensorLayout(0, 1, 1, 1), "weight_packed": TensorLayout(0, 1, 1, 4),
                "weight_scale": TensorLayout(0, 1, None, 1), SHAPE: TensorLayout(None, 1, None, 1)}.get(kind) or \
            super().tensor_layout(kind)

    def process_weights_after_loading(self, layer) -> None:
        # int8.py's checkpoint form, as `leverlab quantize --method int8` writes it: the values need no change
        q, scales = getattr(layer, self.wname).data, layer.weight_scale.data[:, 0].contiguous()
        set_param(layer, "weight", None)
        if self.packed:
            delattr(layer, "weight_packed")
        set_param(layer, "weight_scale", None)
        set_param(layer, "qweight", q)
        set_param(layer, "scales", scales)
        super().process_weights_after_loading(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_activations and x.dtype not in (torch.bfloat16, torch.float16):
            x = quantize_tokens_int8(flatten(x)).view(x.shape)  # float32: the format's activations, exactly
        return super().apply(layer, x)

    def fused_weights(self, layer) -> tuple[int, list] | None:
        if self.quantize_activations and layer.params_dtype not in (torch.bfloat16, torch.float16):
            return None  # float32: the fused kernel would skip apply()'s per-token quantization
        return super().fused_weights(layer)


class CTInt4Method(Int4Method):
    """pack-quantized int4: `weight_packed` int32 [out, in/8], `weight_scale` [out, in/g], with zero points
    `weight_zero_point` int32 [out/8, in/g] (packed along the output rows); `weight_shape` [2]."""

    checkpoint_format = "compressed-tensors"

    def __init__(self, group_size: int, symmetric: bool):
        super().__init__(group_size)
        self.symmetric = symmetric
        self.name = "int4"

    def create_weights(self, layer) -> None:
        super().create_weights(layer)  # dense staging: qweight [out, in] u8, scales [out, in/g], qzeros u8
        # Under the checkpoint's names, so that the loader's missing-tensor check covers them.
        for ours, theirs in (("qweight", "weight_packed"), ("scales", "weight_scale"), ("qzeros", "weight_zero_point")):
            tensor = getattr(layer, ours).data
            set_param(layer, ours, None)
            delattr(layer, ours)
            if theirs == "weight_zero_point" and self.symmetric:
                layer.ct_zeros = torch.full_like(tensor, 8)  # the signed range's zero, in 0..15
            else:
                set_param(layer, theirs, tensor)

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        g = self.group_size
        layouts = {"weight_packed": TensorLayout(0, 1, 1, 8), "weight_scale": TensorLayout(0, 1, 1, g),
                   "weight_zero_point": TensorLayout(0, 8, 1, g), SHAPE: TensorLayout(None, 1, None, 1)}
        return layouts.get(kind) or super().tensor_layout(kind)

    def load_packed(self, layer, kind, tensor, shard) -> None:
        rows = layer.shards[shard][1] if shard is not None else layer.out_features
        if kind == SHAPE:
            return  # the layer knows its shape (and a tensor-parallel slice is not the whole one)
        if kind == "weight_packed":  # signed -8..7 along the inputs -> 0..15
            q = unpack_from_int32(tensor, 4, torch.Size((rows, layer.in_features)))
            self._stage(layer, "weight_packed", (q.to(torch.int16) + 8).to(torch.uint8), shard)
        elif kind == "weight_scale":
            self._stage(layer, "weight_scale", tensor.float(), shard)
        elif kind == "weight_zero_point":
            z = unpack_from_int32(tensor, 4, torch.Size((rows, layer.in_features // self.group_size)), packed_dim=0)
            if self.symmetric:
                check_zero_points(z, f"int4 layer {shard or ''}")
            else:
                self._stage(layer, "weight_zero_point", (z.to(torch.int16) + 8).to(torch.uint8), shard)
        elif kind == "weight_g_idx":  # act-order "weight" writers may store the plain order: only that is read
            if not torch.equal(tensor.to(torch.int64), torch.arange(layer.in_features) // self.group_size):
                raise ValueError("compressed-tensors int4: weight_g_idx permutes the inputs (activation ordering "
                                 "by group), which is not supported")
        else:
            raise ValueError(f"compressed-tensors int4 ({'symmetric' if self.symmetric else 'asymmetric'}) "
                             f"layer: unexpected checkpoint tensor {kind!r}")

    def process_weights_after_loading(self, layer) -> None:
        set_param(layer, "qweight", layer.weight_packed.data)
        set_param(layer, "scales", layer.weight_scale.data)
        set_param(layer, "qzeros", layer.ct_zeros if self.symmetric else layer.weight_zero_point.data)
        for name in ("weight_packed", "weight_scale", "weight_zero_point"):
            if name in layer._parameters:
                delattr(layer, name)
        layer.__dict__.pop("ct_zeros", None)
        super().process_weights_after_loading(layer)


# float-quantized e4m3 is the same tensors as Hugging Face's own fp8 checkpoints, under one scale name
CTFP8Method = FP8CheckpointMethod
