"""Linear layers whose weights may be packed from several checkpoint tensors (q/k/v, gate/up).

A linear layer is the single place where weight precision is decided: every Linear runs through a method
(`self.method.apply`), the unquantized one by default, a quantization method (quant/) once the loader gives it
one (`use`), with the runtime state that method declares (`kernel_state`). The model code never changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leverlab.layers import bf16_linear
from leverlab.quant.base import QuantMethod


class UnquantizedMethod(QuantMethod):
    """The default method: the float weight as loaded. Decode-sized bf16 batches on the CPU take our streaming
    kernel (layers/bf16_linear.py), everything else aten's linear."""

    name = "none"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel_state.tiles:  # the weight in AMX tile order (bf16_linear.to_tiles)
            if x.dtype == torch.bfloat16 and not x.requires_grad:
                return bf16_linear.tiled_linear(x, layer.weight, layer.bias)
            return F.linear(x, self.dequantize(layer).to(x.dtype), layer.bias)
        if bf16_linear.wanted(x, layer.weight):
            return bf16_linear.linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if layer.kernel_state.tiles:
            return bf16_linear.untile(layer.weight).float()
        return layer.weight.float()


UNQUANTIZED = UnquantizedMethod()


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` maps a checkpoint shard id to its (offset, size) rows in the packed W."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, shards: dict | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.use(None)

    def use(self, method: QuantMethod | None) -> None:
        """Run through `method` (None: the unquantized default), with a fresh copy of the runtime state it
        declares; the method's create_weights comes next (models/loader.py: attach_quant_method)."""
        self.method = method if method is not None else UNQUANTIZED
        self.kernel_state = self.method.new_state()

    @property
    def quant_method(self) -> QuantMethod | None:
        """The quantization method this layer runs through; None: plain float weights."""
        return None if self.method is UNQUANTIZED else self.method

    def load(self, kind: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy one checkpoint tensor (`kind` is "weight" or "bias") into its rows of the packed parameter."""
        tensor = self.shard_tensor(kind, tensor, shard)  # tensor parallel: this rank's slice (layers/parallel.py)
        if self.quant_method is not None and self.quant_method.load(self, kind, tensor, shard):
            return  # a pre-quantized tensor (qweight, scales, ...), taken by the method
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {kind} this layer does not take")
        target = param.data
        if shard is not None:
            offset, size = self.shards[shard]
            target = target.narrow(0, offset, size)
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading {kind}{'/' + shard if shard else ''}: "
                             f"checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)

    def shard_tensor(self, kind: str, tensor: torch.Tensor, shard: str | None) -> torch.Tensor:
        return tensor  # unsharded: the whole checkpoint tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


def packed(sizes: dict[str, int]) -> tuple[int, dict[str, tuple[int, int]]]:
    """Total rows and (offset, size) for each named shard, in order."""
    shards, offset = {}, 0
    for name, size in sizes.items():
        shards[name] = (offset, size)
        offset += size
    return offset, shards
