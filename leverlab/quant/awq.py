"""AWQ INT4 checkpoints (AutoAWQ "GEMM" layout, e.g. Qwen/Qwen3-8B-AWQ), loaded without re-quantizing.

Per linear layer, with g = group_size (usually 128):
  qweight int32 [in, out/8]     8 output columns per int32, nibble i holding column 8c + AWQ_ORDER[i]
  qzeros  int32 [in/g, out/8]   integer zero points, packed the same way
  scales  fp16  [in/g, out]
and W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]. The interleaved order exists for AWQ's CUDA kernel's
dequantization trick; we undo it once at load time and hand the int4 kernel its own layout.
"""

from __future__ import annotations

import torch

from leverlab.quant.base import TensorLayout
from leverlab.quant.int4 import Int4Method

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [r, c/8] -> uint8 [r, c]: 8 nibbles per int32 along the last dim, optionally reordered."""
    nib = (packed.to(torch.int32)[..., None] >> _SHIFTS.to(packed.device)) & 0xF  # [r, c/8, 8] in nibble order
    if order is not None:
        nib = nib[..., list(order)]
    return nib.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_cols(vals: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """uint8 [r, c] (0..15) -> int32 [r, c/8], the inverse of unpack_cols (with the inverse order)."""
    r, c = vals.shape
    v = vals.to(torch.int64).reshape(r, c // 8, 8)
    if order is not None:
        v = v[..., list(order)]  # nibble i <- column order[i]
    word = (v << _SHIFTS.to(torch.int64).to(vals.device)).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, scale_dtype=torch.float16) -> dict:
    """Our out-major (q [out, in], scales/zeros [out, in/g]) -> the AWQ GEMM checkpoint tensors."""
    return {
        "qweight": pack_cols(q.t().contiguous(), AWQ_ORDER),
        "qzeros": pack_cols(zeros.t().contiguous(), AWQ_ORDER),
        "scales": scales.t().contiguous().to(scale_dtype),
    }


class AWQMethod(Int4Method):
    name = "awq"
    checkpoint_format = "awq"

    def __init__(self, group_size: int = 128):
        super().__init__(group_size)

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> AWQMethod:
        bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
        version = str(qcfg.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qcfg.get("zero_point", True):
            raise ValueError(f"AWQ checkpoints load when bits=4, version=gemm, zero_point=true; this one has "
                             f"bits={bits}, version={version}, zero_point={qcfg.get('zero_point')}")
        if qcfg.get("modules_to_not_convert"):
            raise ValueError(f"AWQ modules_to_not_convert={qcfg['modules_to_not_convert']} is not supported")
        return cls(int(qcfg.get("group_size", qcfg.get("q_group_size", 128))))

    def config_dict(self) -> dict:
        # What AutoAWQ writes, so other engines (vLLM, transformers) read our `leverlab quantize` output too.
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        g = self.group_size
        layouts = {"qweight": TensorLayout(1, 8, 0, 1), "qzeros": TensorLayout(1, 8, 0, g),
                   "scales": TensorLayout(1, 1, 0, g)}
        return layouts.get(kind) or super().tensor_layout(kind)

    def load_packed(self, layer, kind, tensor, shard) -> None:
        if kind == "qweight":  # [in, size/8] -> [size, in]
            self._stage(layer, "qweight", unpack_cols(tensor, AWQ_REVERSE_ORDER).t(), shard)
        elif kind == "qzeros":  # [in/g, size/8] -> [size, in/g]
            self._stage(layer, "qzeros", unpack_cols(tensor, AWQ_REVERSE_ORDER).t(), shard)
        elif kind == "scales":  # [in/g, size] -> [size, in/g]
            self._stage(layer, "scales", tensor.float().t(), shard)
        else:
            raise ValueError(f"AWQ checkpoint tensor kind {kind!r} is not one of qweight/qzeros/scales")
