"""Weight-only INT8 weights: symmetric, one scale per output channel, round-to-nearest at load time.

W ~= q * s[:, None], q int8 in [-127, 127], s = max|W_row| / 127.

Kernels, CPU:
  up to STREAMING_MAX_ROWS rows (decode, verification, batch-16 decode): our streaming kernel
  (kernels/csrc/quant_linear.cpp); the fused decode path calls it too. It keeps the plain [out, in] copy
  (1 byte per weight) next to fbgemm's packed one. With bf16/fp16 activations `int8` quantizes them per
  32-element block and takes integer dot products (llama.cpp's q8_0 x q8_0 arithmetic: one rounding of each
  activation, at most half a step of its block's max|x| / 127); widening each weight to float instead left the
  kernel compute-bound at about a third of that speed on a small model. With AVX-512 VNNI that copy is held as
  panels of 16 rows (pack_int8_panels: a load and one vpdpbusd per 64 bytes). `int8-woq` keeps the activations
  as they are (weight-only, the float path, on rows).
  More rows, bf16/fp16, from `w8a8_min_rows` rows on (default 1: always): fbgemm's int8 x int8 GEMM
  (int8_gemm.py) with the activations quantized per row on the fly (W8A8); on the bundled model it moved
  perplexity by under 0.01% (docs/quantization.md).
  below that (`--quantization int8-woq`: 9, so only where the streaming kernel is missing): weight-only
  `aten._weight_int8pack_mm` (activations untouched). It keeps a second, unpacked int8 copy for that kernel.
fp32 activations, and CUDA: `torch.mm(x, q.t().to(x.dtype)) * s`, exact against the dequantized weight
(the form Inductor's weight-only-int8 pattern matches); the tests run this path in float32.
"""

from __future__ import annotations

import torch

from leverlab.kernels import cpu_kernels
from leverlab.quant import int8_gemm
from leverlab.quant.base import (
    QuantMethod,
    TensorLayout,
    copy_checked,
    flatten,
    set_param,
    shard_rows,
)
from leverlab.quant.layouts import pack_int8_panels, quantize_int8


def streaming_kernels(device: torch.device):
    """The C++ kernels' module when the streaming int8/int4 kernels can run on `device`, else None."""
    if device.type != "cpu":
        return None
    return cpu_kernels.kernels()


def use_int8_gemm(layer, dtype: torch.dtype, device: torch.device) -> bool:
    return int8_gemm.available() and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


class Int8Method(QuantMethod):
    name = "int8"
    bits_per_weight = 8.0  # + one scale per row, negligible
    # Tensor parallel: a row-parallel rank's slice is quantized with its whole rows' scales (layers/parallel.py),
    # so TP=N holds TP=1's int8 weights exactly.
    whole_row_scales = True

    def __init__(self, checkpoint: bool = False, w8a8_min_rows: int | None = 1):
        self.checkpoint = checkpoint  # True: weights come as qweight/scales from a `leverlab quantize` folder
        self.w8a8_min_rows = w8a8_min_rows  # None: never the int8 x int8 path
        # The streaming kernel quantizes bf16/fp16 activations (per 32-block) unless weight-only was asked for.
        self.quantize_activations = w8a8_min_rows is not None and w8a8_min_rows <= 1

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> Int8Method:
        if int(qcfg.get("bits", 8)) != 8:
            raise ValueError(f"int8 checkpoint with bits={qcfg.get('bits')}")
        return cls(checkpoint=True)

    def config_dict(self) -> dict:
        return {"quant_method": "int8", "bits": 8, "symmetric": True, "granularity": "per-channel"}

    def create_weights(self, layer) -> None:
        layer.params_dtype = layer.weight.dtype  # the activation dtype: scales are kept in it
        if not self.checkpoint:
            return  # keep the float weight; it is quantized in process_weights_after_loading
        dev = layer.weight.device
        set_param(layer, "qweight", torch.zeros(layer.out_features, layer.in_features, dtype=torch.int8, device=dev))
        set_param(layer, "scales", torch.zeros(layer.out_features, dtype=torch.float32, device=dev))
        set_param(layer, "weight", None)

    def load(self, layer, kind, tensor, shard) -> bool:
        if kind in ("qweight", "scales") and self.checkpoint:
            copy_checked(shard_rows(layer, getattr(layer, kind).data, shard), tensor, f"{kind}/{shard}")
            return True
        return False

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        # `leverlab quantize` int8: qweight [out, in], scales [out] (a row's scale serves any slice of its inputs)
        return {"qweight": TensorLayout(0, 1, 1, 1), "scales": TensorLayout(0, 1, None, 1)}.get(kind) or \
            super().tensor_layout(kind)

    def process_weights_after_loading(self, layer) -> None:
        state = layer.kernel_state
        if self.checkpoint:
            q, scales = layer.qweight.data, layer.scales.data.float()
        else:
            # Tensor parallel: a row-parallel slice takes its rows' scales from the whole rows (layers/parallel.py)
            q, scales = quantize_int8(layer.weight.data, getattr(layer, "whole_row_absmax", None))
            layer.whole_row_absmax = None
            set_param(layer, "weight", None)
        state.int8_key = None
        # Our streaming kernel (csrc/quant_linear.cpp) serves up to STREAMING_MAX_ROWS rows on the CPU from its
        # own copy: the plain [out, in] one, or with AVX-512 VNNI panels of 16 rows where its integer path runs
        # (bf16/fp16 activations quantized; other calls would unpack the panels each time).
        kern = streaming_kernels(q.device)
        state.stream = (q.contiguous(), scales.float().contiguous()) if kern else None
        if (kern and self.quantize_activations and kern.has_fast_int6() and q.shape[0] % 16 == 0
                and q.shape[1] % 32 == 0 and layer.params_dtype in (torch.bfloat16, torch.float16)):
            state.stream = (pack_int8_panels(q), state.stream[1])
        if self.w8a8_min_rows is not None and use_int8_gemm(layer, layer.params_dtype, q.device):
            state.int8_key = int8_gemm.pack(layer, q, scales)
            if self.w8a8_min_rows <= 1:  # the packed copy serves every batch size: drop the plain one
                set_param(layer, "qweight", None)
                set_param(layer, "scales", None)
                return
        set_param(layer, "qweight", q.contiguous())
        # The scales live in the activation dtype: the aten kernel takes them so, and the epilogue is exact.
        set_param(layer, "scales", scales.to(layer.params_dtype))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        state = layer.kernel_state
        x2 = flatten(x)
        if state.stream is not None and x2.shape[0] <= state.stream_rows:
            y = streaming_kernels(x.device).int8_linear(x2, *state.stream, layer.bias, self.quantize_activations)
            return y.view(*x.shape[:-1], layer.out_features)
        if state.int8_key is not None and x2.shape[0] >= self.w8a8_min_rows:
            y = int8_gemm.int8_linear(x2, state.int8_key, layer.out_features)
        elif x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            y = torch.ops.aten._weight_int8pack_mm(x2, layer.qweight, layer.scales.to(x.dtype))
        else:
            y = torch.mm(x2, layer.qweight.t().to(x.dtype)) * layer.scales.to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def fused_weights(self, layer) -> tuple[int, list] | None:
        kind = 3 if self.quantize_activations else 1  # fused_decoder.cpp: 3 quantizes bf16/fp16 activations
        return (kind, [*layer.kernel_state.stream, layer.bias]) if layer.kernel_state.stream is not None else None

    def dequantize(self, layer) -> torch.Tensor:
        if layer.qweight is None:
            q, scales = int8_gemm.unpack(layer.kernel_state.int8_key)
            return q.float() * scales[:, None]
        return layer.qweight.float() * layer.scales.float()[:, None]

    def bytes_read(self, layer, rows: int) -> int:
        state = layer.kernel_state
        bias = layer.bias.numel() * layer.bias.element_size() if layer.bias is not None else 0
        if state.stream is not None and rows <= state.stream_rows:
            return state.stream[0].numel() + 4 * layer.out_features + bias
        if state.int8_key is not None and rows >= self.w8a8_min_rows:
            return layer.out_features * (layer.in_features + 4) + bias  # the packed int8 weight + fp32 scales
        return layer.qweight.numel() + layer.scales.numel() * layer.scales.element_size() + bias

    def export(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_int8(weight)
        return {"qweight": q, "scales": scales.to(weight.dtype if weight.is_floating_point() else torch.float32)}
