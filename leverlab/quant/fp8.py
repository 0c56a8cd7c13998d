"""FP8 (e4m3) weights, one scale per output channel: W ~= w8.float() * s[:, None], s = max|W_row| / 448.

On a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper) the matmul is the native one:
activations are quantized to e4m3 per token on the fly and `torch._scaled_mm` multiplies the two FP8
operands with row-wise scales, writing the model dtype. Not run here (no GPU on the development machines).

On the CPU there is no FP8 matmul: FP8 is a storage format. The weight is converted to the activation dtype
inside the matmul, so the layer holds half the bytes of bf16 (memory footprint, checkpoint size) but every
call still streams a bf16-sized weight through the GEMM after the conversion: expect decode no faster than
bf16, usually slower. Under the compiled path Inductor may fold the conversion into a frozen bf16 constant,
which gives bf16 speed and bf16 memory. Use int8 for CPU speed; this method is here for GPU serving and for
its numerics (e4m3 keeps 3 mantissa bits: coarser than int8 per channel on well-behaved rows).
"""

from __future__ import annotations

import torch

from leverlab.quant.base import QuantMethod, flatten, set_param

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (w8 e4m3 [out, in], scales float32 [out])."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def _native_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Method(QuantMethod):
    name = "fp8"
    bits_per_weight = 8.0

    def process_weights_after_loading(self, layer) -> None:
        w8, scales = quantize_fp8(layer.weight.data)
        dtype = layer.weight.dtype
        set_param(layer, "weight", None)
        set_param(layer, "qweight", w8)
        set_param(layer, "scales", scales.to(torch.float32 if _native_fp8(w8.device) else dtype))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        x2 = flatten(x)
        if _native_fp8(x.device):
            # Per-token activation scales; _scaled_mm wants the second operand column-major: w8.t() is.
            sx = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
            xq = (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            y = torch._scaled_mm(xq, layer.qweight.t(), scale_a=sx, scale_b=layer.scales[None, :],
                                 out_dtype=x.dtype)
        else:
            y = torch.mm(x2, layer.qweight.t().to(x.dtype)) * layer.scales.to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], layer.out_features)

    def dequantize(self, layer) -> torch.Tensor:
        return layer.qweight.float() * layer.scales.float()[:, None]
