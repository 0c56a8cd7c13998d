"""Pre-quantized FP8 (e4m3) checkpoints: compressed-tensors' float-quantized layers (per channel, per tensor or per
block: compressed_tensors.py picks this per config group) and Hugging Face's own fp8 format (Qwen's Qwen3-*-FP8:
`weight_block_size` [128, 128] and `weight_scale_inv`), the same tensors under another scale name.

Stored as e4m3 and widened in the matmul on the CPU, as fp8.py does: per-channel and per-tensor scales become
fp8.py's own per-row form (its GPU path included); block scales are applied to the widened weight at each call.
"""

from __future__ import annotations

import torch

from leverlab.errors import UnsupportedLever
from leverlab.quant.base import TensorLayout, copy_checked, flatten, set_param, shard_rows
from leverlab.quant.fp8 import FP8, FP8Method


def check_zero_points(z: torch.Tensor, what: str) -> None:
    """Older writers store a symmetric layer's zero points too (all zero): taken and checked, never applied."""
    if torch.count_nonzero(z):
        raise ValueError(f"compressed-tensors: {what} has non-zero weight_zero_point values, but its scheme is "
                         "symmetric")


class FP8CheckpointMethod(FP8Method):
    """e4m3 `weight` [out, in] with its scale (`scale_name`) [out, 1] (channel), [1] (tensor) or
    [ceil(out/br), ceil(in/bc)] (block [br, bc]). Per-tensor scales are held per row (the same numbers); block
    scales are held per row and block column, spread over each shard's own rows (a shard need not start on a
    block boundary of the packed layer)."""

    def __init__(self, strategy: str, block: tuple[int, int] | None = None, scale_name: str = "weight_scale",
                 skip: tuple[str, ...] = ()):
        self.strategy, self.block, self.scale = strategy, block, scale_name
        self.skip = skip  # module names left in the model dtype (modules_to_not_convert)
        self.name = "fp8"

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> FP8CheckpointMethod:
        """Hugging Face's fp8 checkpoints (Qwen's own Qwen3-*-FP8, transformers' FineGrainedFP8, vLLM's "fp8"):
        weight_block_size [128, 128] with `weight_scale_inv` per block (a multiplier, despite its name), or
        without it one `weight_scale` per tensor."""
        unknown = set(qcfg) - {"quant_method", "fmt", "activation_scheme", "weight_block_size",
                               "modules_to_not_convert", "ignored_layers"}
        if unknown:
            raise UnsupportedLever(f"fp8 checkpoint: quantization_config field(s) {', '.join(sorted(unknown))} "
                                   "not supported")
        if str(qcfg.get("fmt", "e4m3")).lower() != "e4m3":
            raise UnsupportedLever(f"fp8 checkpoint: fmt {qcfg['fmt']!r} is not supported (e4m3 only)")
        if str(qcfg.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise UnsupportedLever(f"fp8 checkpoint: activation_scheme {qcfg['activation_scheme']!r} (static "
                                   "activation scales, input_scale) is not supported")
        skip = tuple(qcfg.get("modules_to_not_convert") or qcfg.get("ignored_layers") or ())
        block = qcfg.get("weight_block_size")
        if block is None:
            return cls("tensor", None, "weight_scale", skip)
        if len(block) != 2:
            raise UnsupportedLever(f"fp8 checkpoint: weight_block_size {block} is not [rows, cols]")
        return cls("block", (int(block[0]), int(block[1])), "weight_scale_inv", skip)

    def for_layer(self, parts: list[str], layer) -> FP8CheckpointMethod | None:
        skipped = {any(p == s or p.endswith("." + s) or p.startswith(s + ".") for s in self.skip) for p in parts}
        if len(skipped) > 1:
            raise UnsupportedLever(f"fp8 checkpoint: modules_to_not_convert lists some of {', '.join(parts)}, "
                                   "which we pack into one layer")
        return None if skipped.pop() else self

    def create_weights(self, layer) -> None:
        layer.params_dtype = layer.weight.dtype
        dev, out = layer.weight.device, layer.out_features
        cols = -(-layer.in_features // self.block[1]) if self.block else 1
        set_param(layer, "weight", torch.zeros(out, layer.in_features, dtype=FP8, device=dev))
        set_param(layer, self.scale, torch.zeros(out, cols, dtype=torch.float32, device=dev))

    def load(self, layer, kind, tensor, shard) -> bool:
        if kind == "weight":
            if tensor.dtype != FP8:
                raise ValueError(f"fp8 checkpoint: weight/{shard} is {tensor.dtype}, not float8_e4m3fn")
            copy_checked(shard_rows(layer, layer.weight.data, shard), tensor, f"weight/{shard}")
            return True
        if kind == self.scale:
            target = shard_rows(layer, getattr(layer, self.scale).data, shard)
            s = tensor.float()
            if self.strategy == "tensor":
                if s.numel() != 1:
                    raise ValueError(f"fp8 checkpoint: per-tensor {kind}/{shard} has {s.numel()} values")
                s = s.reshape(1, 1).expand(target.shape)
            elif self.strategy == "block":
                s = s.repeat_interleave(self.block[0], dim=0)[: target.shape[0]]
            copy_checked(target, s, f"{kind}/{shard}")
            return True
        if kind == "weight_zero_point":
            check_zero_points(tensor, f"fp8 layer {shard or ''}")
            return True
        return False

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        if kind == "weight":
            return TensorLayout(0, 1, 1, 1)
        if kind == self.scale and self.strategy == "channel":
            return TensorLayout(0, 1, None, 1)
        return None if kind == self.scale else super().tensor_layout(kind)  # block / tensor: not split

    def process_weights_after_loading(self, layer) -> None:
        w8, scales = layer.weight.data, getattr(layer, self.scale).data
        set_param(layer, "weight", None)
        set_param(layer, self.scale, None)
        set_param(layer, "qweight", w8)
        if self.block is None:  # fp8.py's own form: one scale per row
            scales = scales[:, 0].contiguous()
            native = layer.qweight.device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
            set_param(layer, "scales", scales if native else scales.to(layer.params_dtype))
        else:
            set_param(layer, "scales", scales.to(layer.params_dtype))

    def _block_weight(self, layer, dtype: torch.dtype) -> torch.Tensor:
        s = layer.scales.to(dtype).repeat_interleave(self.block[1], dim=1)[:, : layer.in_features]
        return layer.qweight.to(dtype) * s

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if self.block is None:
            return super().apply(layer, x)
        # No FP8 matmul on the CPU: widen the weight, scale each block, multiply (fp8.py: a storage format here).
        y = torch.mm(flatten(x), self._block_weight(layer, x.dtype).t())
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def dequantize(self, layer) -> torch.Tensor:
        if self.block is None:
            return super().dequantize(layer)
        return self._block_weight(layer, torch.float32)
