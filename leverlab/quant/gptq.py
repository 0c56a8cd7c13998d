"""GPTQ INT4 checkpoints (AutoGPTQ / GPTQModel layout), loaded without re-quantizing.

Per linear layer, with g = group_size:
  qweight int32 [in/8, out]     8 consecutive input rows per int32, row 8r + j in nibble j
  qzeros  int32 [in/g, out/8]   zero points, 8 consecutive output columns per int32; the original ("v1")
                                format stores zero - 1, `checkpoint_format: gptq_v2` stores the zero itself
  scales  fp16  [in/g, out]
  g_idx   int32 [in]            group of each input channel: i // g, or a permutation with desc_act
and W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o].
With desc_act (act-order) groups are not contiguous in the input: we sort the input channels by group once
(a permutation shared by q/k/v, which read the same input) and gather x by it in the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leverlab.quant.base import KernelState, TensorLayout
from leverlab.quant.int4 import Int4Method
from leverlab.quant.layouts import unpack_cols, unpack_rows


@dataclass
class GPTQState(KernelState):
    perm_seen: bool = False  # a shard's g_idx has set `perm`: the other shards of the packed layer must agree


class GPTQMethod(Int4Method):
    name = "gptq"
    checkpoint_format = "gptq"

    def __init__(self, group_size: int = 128, zero_offset: int = 1):
        super().__init__(group_size)
        self.zero_offset = zero_offset  # added to stored zeros: 1 for v1 checkpoints, 0 for gptq_v2

    def new_state(self) -> GPTQState:
        return GPTQState()

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> GPTQMethod:
        bits, group = int(qcfg.get("bits", 4)), int(qcfg.get("group_size", 128))
        if bits != 4:
            raise ValueError(f"GPTQ checkpoints load with bits=4; this one has bits={bits}")
        if group == -1:
            raise ValueError("GPTQ group_size=-1 (one group per row) is not supported; use a grouped checkpoint")
        fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
        return cls(group, zero_offset=0 if fmt == "gptq_v2" else 1)

    def config_dict(self) -> dict:
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "sym": False,
                "desc_act": False, "checkpoint_format": "gptq" if self.zero_offset else "gptq_v2"}

    def tensor_layout(self, kind: str) -> TensorLayout | None:
        g = self.group_size
        layouts = {"qweight": TensorLayout(1, 1, 0, 8), "qzeros": TensorLayout(1, 8, 0, g),
                   "scales": TensorLayout(1, 1, 0, g), "g_idx": TensorLayout(None, 1, 0, 1)}
        return layouts.get(kind) or super().tensor_layout(kind)

    def load_packed(self, layer, kind, tensor, shard) -> None:
        if kind == "qweight":  # [in/8, size] -> [size, in]
            self._stage(layer, "qweight", unpack_rows(tensor).t(), shard)
        elif kind == "qzeros":  # [in/g, size/8] -> [size, in/g]
            zeros = unpack_cols(tensor, None).to(torch.int16) + self.zero_offset
            self._stage(layer, "qzeros", zeros.t().to(torch.uint8), shard)
        elif kind == "scales":
            self._stage(layer, "scales", tensor.float().t(), shard)
        elif kind == "g_idx":
            self._load_g_idx(layer, tensor.to(torch.int64), shard)
        else:
            raise ValueError(f"GPTQ checkpoint tensor kind {kind!r} is not one of qweight/qzeros/scales/g_idx")

    def _load_g_idx(self, layer, g_idx: torch.Tensor, shard) -> None:
        plain = torch.arange(layer.in_features, device=g_idx.device) // self.group_size
        if torch.equal(g_idx, plain):
            perm = None
        else:
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], plain):
                raise ValueError("GPTQ g_idx does not put exactly group_size channels in each group")
        state = layer.kernel_state
        if state.perm_seen and not _same(state.perm, perm):
            raise ValueError(f"GPTQ shards of one packed layer have different g_idx (shard {shard})")
        state.perm_seen, state.perm = True, perm


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
