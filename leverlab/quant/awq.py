"""AWQ INT4 checkpoints (AutoAWQ "GEMM" layout, e.g. Qwen/Qwen3-8B-AWQ), loaded without re-quantizing.

Per linear layer, with g = group_size (usually 128):
  qweight int32 [in, out/8]     8 output columns per int32, nibble i holding column 8c + AWQ_ORDER[i]
  qzeros  int32 [in/g, out/8]   integer zero points, packed the same way
  scales  fp16  [in/g, out]
and W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]. The interleaved order exists for AWQ's CUDA kernel's
dequantization trick; we undo it once at load time and hand the int4 kernel its own layout.
"""

from __future__ import annotations

from leverlab.quant.base import TensorLayout
from leverlab.quant.int4 import Int4Method
from leverlab.quant.layouts import AWQ_REVERSE_ORDER, unpack_cols


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
