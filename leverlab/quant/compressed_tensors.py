"""compressed-tensors W8A8 int8, for export: the format llm-compressor writes and vLLM's CPU build runs on
its int8 GEMM (CPUInt8ScaledMMLinearKernel). `leverlab quantize SRC DST --method w8a8` writes it, so vLLM can be
measured at 8 bits on a CPU, where its on-the-fly fp8 does not run (docs/bench.md has the error it gives).

The math is our int8's: per-output-channel symmetric weights, round to nearest (quant/layouts.py quantize_int8), and
activations quantized per token at run time (dynamic), as our int8 does for batched rows. The tensors keep their
names (`...q_proj.weight` becomes int8) beside a `weight_scale` [out, 1] in float32; the output head is left as it
is (listed under "ignore"). LeverLab's own loader does not read this format yet and says so.
"""

from __future__ import annotations

import torch

from leverlab.quant.layouts import quantize_int8


class W8A8Export:
    name = "w8a8"

    def export(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_int8(weight)
        return {"weight": q, "weight_scale": scales[:, None].float()}

    def config_dict(self) -> dict:
        int8 = {"num_bits": 8, "type": "int", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**int8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**int8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
