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
from leverlab.quant.int8 import streaming_kernels, use_int8_gemm
from leverlab.quant.layouts import (
    INT4_GROUP_SIZES,
    QUAD,
    dequantize_int6_streaming,
    is_int6_interleaved,
    pack_int6_interleaved,
    pack_int6_panels,
    pack_int6_streaming,
    quantize_int6,
    quantize_int8,
)


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
        state = layer.kernel_state
        q, s, z = quantize_int6(layer.weight.data, self.group_size)
        packed, ss = pack_int6_streaming(q, s, z, self.group_size)
        dev = layer.weight.device
        set_param(layer, "weight", None)
        kern = streaming_kernels(dev)
        state.stream = (packed, ss) if kern is not None else None
        if (kern is not None and kern.has_fast_int6() and layer.out_features % 16 == 0
                and layer.params_dtype in (torch.bfloat16, torch.float16)):  # panels of 16 rows, as int4's
            state.stream = (pack_int6_panels(q, s, z, self.group_size), ss)
        elif (kern is not None and kern.has_int4_interleaved() and self.group_size == 64
              and layer.in_features % 256 == 0 and layer.params_dtype in (torch.bfloat16, torch.float16)):
            state.stream = (pack_int6_interleaved(q), ss)  # AVX2: groups interleaved four at a time, as int4's
        state.int8_key = None
        state.dense = None
        if use_int8_gemm(layer, layer.params_dtype, dev):  # the batched rows' copy (Int4Method's docstring)
            state.int8_key = int8_gemm.pack(layer, *quantize_int8(dequantize_int6_streaming(packed, ss)))
        if state.stream is None:  # no kernel of ours here: the weight dequantized, in the model dtype
            state.dense = dequantize_int6_streaming(packed, ss).to(layer.params_dtype)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        state = layer.kernel_state
        x2 = flatten(x)
        rows = x2.shape[0]
        if state.stream is not None and rows <= state.stream_rows:
            y = streaming_kernels(x.device).int6_linear(x2, *state.stream, self.group_size, layer.bias)
            return y.view(*x.shape[:-1], layer.out_features)
        if state.int8_key is not None and rows >= self.w8a8_min_rows:
            y = int8_gemm.int8_linear(x2, state.int8_key, layer.out_features).to(x.dtype)
        elif state.stream is not None:
            y = streaming_kernels(x.device).int6_linear(x2, *state.stream, self.group_size, None)
        else:
            y = x2 @ state.dense.t().to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def fused_weights(self, layer) -> tuple[int, list] | None:
        return (4, [*layer.kernel_state.stream, layer.bias]) if layer.kernel_state.stream is not None else None  # fused_decoder.cpp: kind 4

    def dequantize(self, layer) -> torch.Tensor:
        if layer.kernel_state.stream is None:
            return layer.kernel_state.dense.float()
        return dequantize_int6_streaming(*layer.kernel_state.stream)

    def bytes_read(self, layer, rows: int) -> int:
        state = layer.kernel_state
        bias = layer.bias.numel() * layer.bias.element_size() if layer.bias is not None else 0
        panels = state.stream is not None and state.stream[0].dim() == 3 and not is_int6_interleaved(state.stream[0])
        streamed = state.stream[0].numel() + (0 if panels else state.stream[1].numel() * 2) \
            if state.stream is not None else 0  # (panels carry their scales)
        if state.stream is not None and rows <= state.stream_rows:
            return streamed + bias
        if state.int8_key is not None and rows >= self.w8a8_min_rows:
            return layer.out_features * (layer.in_features + 4) + bias
        if state.stream is not None:
            return streamed + bias
        return state.dense.numel() * state.dense.element_size() + bias
