"""Linear layers whose weights may be packed from several checkpoint tensors (q/k/v, gate/up).

A linear layer is the single place where weight precision is decided: quantization methods (issue 6)
replace `forward` and the stored weight through `quant_method`, and the model code never changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leverlab.layers import bf16_linear


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` maps a checkpoint shard id to its (offset, size) rows in the packed W."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, shards: dict | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.quant_method = None  # a leverlab.quant QuantMethod, set by the loader; None: plain float weights

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
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        if bf16_linear.wanted(x, self.weight):  # decode-sized bf16 batches on CPU: our streaming kernel
            return bf16_linear.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def packed(sizes: dict[str, int]) -> tuple[int, dict[str, tuple[int, int]]]:
    """Total rows and (offset, size) for each named shard, in order."""
    shards, offset = {}, 0
    for name, size in sizes.items():
        shards[name] = (offset, size)
        offset += size
    return offset, shards
