"""GGUF Q4_0 projections on our int4 kernels, bit for bit.

llama.cpp's Q4_0 is W = d * (q - 8) per block of 32 input channels, d in fp16: our int4 at a group size of 32
with an integer zero point of 8 and the same fp16 scale (quant/layouts.py unpack_q4_0). models/gguf_loader.py
hands this method each projection already unpacked into int4's staging form (qweight [out, in] uint8, scales
[out, in / 32] float32, qzeros [out, in / 32] uint8), so loading only stages rows; process_weights_after_loading
is int4's and packs them for the streaming kernel (rows or AVX-512 VNNI panels) as for any int4 checkpoint, except
that the panels leave the zero points out (all 8): a group of 32 streams 18 bytes, Q4_0's own block size, where
int4-g32's panels stream 20 (its zero points in fp16), which had made the Q4_0 file decode 0.90-0.93x our int4 at
groups of 64 (scripts/bench_gguf.py).

The method keeps int4's name: it is int4 (the same kernels, the same head choice by --lm-head-quantization).
"""

from __future__ import annotations

from leverlab.quant.base import TensorLayout
from leverlab.quant.int4 import Int4Method
from leverlab.quant.layouts import GGUF_BLOCK


class GGUFQ4Method(Int4Method):
    name = "int4"
    checkpoint_format = "gguf-q4_0"
    zero_point_free = True  # every zero point is Q4_0's 8: the AVX-512 VNNI panels do not store them

    def __init__(self, group_size: int = GGUF_BLOCK):
        super().__init__(group_size)
        # 4 bits + the fp16 scale per group: Q4_0's 4.5 at 32, as the zero-point-free panels stream it (the AVX2
        # row layout still reads int4's zero points beside the rows: 5)
        self.bits_per_weight = 4 + 16 / group_size

    def config_dict(self) -> dict:
        return {"quant_method": "int4", "bits": 4, "group_size": self.group_size, "source": "gguf q4_0"}

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        # the staging form, out-major: a tensor-parallel slice cuts rows, or inputs by whole groups
        g = self.group_size
        layouts = {"qweight": TensorLayout(0, 1, 1, 1), "scales": TensorLayout(0, 1, 1, g),
                   "qzeros": TensorLayout(0, 1, 1, g)}
        return layouts.get(kind) or super().tensor_layout(kind)

    def load_packed(self, layer, kind, tensor, shard) -> None:
        if kind not in ("qweight", "scales", "qzeros"):
            raise ValueError(f"GGUF Q4_0 tensor kind {kind!r} is not one of qweight/scales/qzeros")
        self._stage(layer, kind, tensor, shard)
