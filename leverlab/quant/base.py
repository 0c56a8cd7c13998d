"""The per-layer quantization interface, after vLLM's `LinearMethodBase`.

One method object serves every quantized `Linear` of a model; the per-layer state (packed weights,
scales) lives on the layer itself as parameters, so `torch.compile` with freezing sees them as constants
and can prepack them, and `model.to()` / `state_dict()` keep working.

Life of a quantized layer:
  1. `create_weights(layer)` right after the model is built: replace or keep `layer.weight`, register
     whatever the checkpoint will fill (e.g. AWQ `qweight` / `qzeros` / `scales`).
  2. `load(layer, kind, tensor, shard)` for each checkpoint tensor of the layer; returns False to let the
     layer copy a plain floating-point tensor itself (quantize-at-load methods read bf16/fp32 weights).
     `shard` names the q/k/v or gate/up part; its rows are `layer.shards[shard]` = (offset, size).
  3. `process_weights_after_loading(layer)` once every tensor is in: quantize / repack into the kernel's
     layout and free the staging tensors.
  4. `apply(layer, x)` in the forward: x [..., in_features] -> [..., out_features] in x's dtype (+ bias).

Invariant: after step 3, `dequantize(layer)` returns the [out, in] float32 weight that `apply` multiplies
by (up to the activation dtype's rounding); the tests hold every method to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

STREAMING_MAX_ROWS = 16  # rows up to which our streaming kernels beat the batched GEMMs (csrc: quant_max_rows)

# Checkpoint module names that a weight-quantization method converts by default. The output head and the
# embeddings stay in the model dtype, as AWQ/GPTQ checkpoints keep them: the tied head is also the input
# embedding table (a gather, not a matmul), and the head's logits are the most precision-sensitive output.
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorLayout:
    """Where a checkpoint tensor keeps a layer's output and input features, for tensor-parallel slicing
    (layers/parallel.py): the dimension (None: not along it) and how many features one element covers
    (8 for nibbles packed in an int32, the group size for per-group scales and zeros)."""

    out_dim: int | None
    out_pack: int = 1
    in_dim: int | None = None
    in_pack: int = 1


# Float checkpoint tensors: weight [out, in], bias [out].
DEFAULT_LAYOUTS = {"weight": TensorLayout(0, 1, 1, 1), "bias": TensorLayout(0, 1, None, 1)}


@dataclass
class KernelState:
    """The runtime state a quantization method keeps on a layer besides its parameters: the kernels' own copies of
    the weight and which of them a call takes. A method declares it (QuantMethod.new_state), the layer holds it as
    `layer.kernel_state` from the moment it takes the method (Linear.use), and the method fills it in
    process_weights_after_loading; the fused decoder, autotune and huge pages read these fields, never probe."""

    # Our streaming kernel's (weights, scales) in its layout (rows, AVX-512 VNNI panels or AVX2 interleaved),
    # for up to stream_rows rows on the CPU; None: no kernel of ours here.
    stream: tuple[torch.Tensor, torch.Tensor] | None = None
    int8_key: Any = None  # fbgemm's / our AMX int8 GEMM's packed copy for batched rows (quant/int8_gemm.py)
    stream_rows: int = STREAMING_MAX_ROWS  # the streaming kernel takes calls of up to this many rows (autotune.py)
    row_times: dict[int, tuple[float, float]] | None = None  # rows -> (streaming, GEMM) seconds, where timed
    perm: torch.Tensor | None = None  # GPTQ act-order: the input permutation that makes groups contiguous
    dense: torch.Tensor | None = None  # int6 without our kernels: the weight dequantized, in the model dtype
    tiles: bool = False  # an unquantized bf16 layer whose `weight` is held in AMX tile order (layers/bf16_linear.py)


class QuantMethod:
    name: str = ""
    bits_per_weight: float = 16.0  # storage per weight, scales included (for bytes-per-token estimates)
    # True (`int8+head`, `int4+head`): the output head in this same method. Otherwise the head's method is chosen
    # by --lm-head-quantization (registry.head_quant_method): int8 for int8, int6 (or int8) for int4 by default.
    quantize_lm_head: bool = False

    def new_state(self) -> KernelState:
        """The runtime state this method keeps on each layer (KernelState's fields; a method may extend it)."""
        return KernelState()

    def for_layer(self, parts: list[str], layer: nn.Module) -> QuantMethod | None:
        """The method for one layer, given the checkpoint module names it holds (q_proj, k_proj, v_proj of a
        packed qkv layer; ["lm_head"] for the head, whose own method is chosen apart): this one. A checkpoint
        whose config gives layers different methods (compressed-tensors' groups) answers per layer, None
        where its layers stay in the model dtype, and refuses a head it quantizes."""
        return self

    def attached(self) -> None:
        """Called once every layer has asked for_layer: a config naming layers this model lacks says so here."""

    def create_weights(self, layer: nn.Module) -> None:
        """Default: keep the floating-point `layer.weight`, filled from the checkpoint and converted later."""

    def load(self, layer: nn.Module, kind: str, tensor: torch.Tensor, shard: str | None) -> bool:
        """Take a pre-quantized checkpoint tensor; False lets the layer load `weight`/`bias` as usual."""
        return False

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        """How checkpoint tensor `kind` lays out the features (None: unknown, refused at TP > 1). Methods
        that read pre-quantized tensors describe theirs; quantize-at-load methods read float tensors."""
        return DEFAULT_LAYOUTS.get(kind)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """[out, in] float32: the weight that `apply` effectively multiplies by."""
        raise NotImplementedError

    def fused_weights(self, layer: nn.Module) -> tuple[int, list] | None:
        """(kind, [weight, scale, bias]) for the fused decode path's streaming kernels (models/fused.py,
        csrc/quant_linear.cpp), or None: no such kernel for this layer, and the model keeps the module path."""
        return None

    def bytes_read(self, layer: nn.Module, rows: int) -> int:
        """Bytes of this layer's tensors that one matmul of `rows` rows reads (default: all of them)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters())

    def config_dict(self) -> dict:
        """What `leverlab quantize` writes as config.json's quantization_config."""
        return {"quant_method": self.name}

    def export(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize one checkpoint weight [out, in] into the named tensors (suffix -> tensor) of this method's
        checkpoint layout, for `leverlab quantize`. Methods without a checkpoint layout raise."""
        raise NotImplementedError(f"{self.name} has no checkpoint format; quantize it at load time instead")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config_dict()})"


def set_param(layer: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Register (or with None, drop) a frozen parameter; integer tensors are fine with requires_grad=False.
    A quantized output head keeps an empty `weight` on its device (code probes `lm_head.weight.device`); a tied
    head's embedding table is the embedding's own parameter and stays there."""
    if name == "weight" and tensor is None and getattr(layer, "is_lm_head", False):
        tensor = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)
    if name in layer._parameters:
        del layer._parameters[name]
    if hasattr(layer, name) and name not in layer._parameters:
        delattr(layer, name)
    if tensor is None:
        layer._parameters[name] = None  # keeps `layer.weight` resolvable (as None) for code that probes it
    else:
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def shard_rows(layer: nn.Module, target: torch.Tensor, shard: str | None) -> torch.Tensor:
    """The rows of a [out, ...] tensor that `shard` occupies in a packed layer (all of them for None)."""
    if shard is None:
        return target
    offset, size = layer.shards[shard]
    return target.narrow(0, offset, size)


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
    target.copy_(tensor)


def flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])
