"""One step's inputs, as rank 0 broadcasts them to the other ranks: two int64 tensors on the control group.

  header  [HEADER_LEN]: command, T (new tokens), B (sequences), W (block-table width), R (logit rows)
  payload [3T + B*W + B + (B+1) + R]: token ids, positions, cache slots, block tables (row-major),
          context lengths, query start offsets, the rows whose logits are wanted

Two fixed-order broadcasts and no pickling: the header says how long the payload is. The block tables come
from rank 0's block manager, the only one: every rank writes its KV heads into the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_LEN = 6
STEP, SHUTDOWN = 1, 2


@dataclass
class StepInputs:
    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, W]
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]
    rows: torch.Tensor  # [R]: hidden rows to compute logits for (R = 0: none this step)


def pack(ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], seq_lens: list[int],
         starts: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t, b, w, r = len(ids), len(seq_lens), len(tables[0]) if tables else 0, len(rows)
    header = torch.tensor([STEP, t, b, w, r, 0], dtype=torch.int64)
    flat = [x for row in tables for x in row]
    payload = torch.tensor(ids + positions + slots + flat + seq_lens + starts + rows, dtype=torch.int64)
    return header, payload


def payload_len(header: torch.Tensor) -> int:
    _, t, b, w, r, _ = header.tolist()
    return 3 * t + b * w + b + (b + 1) + r


def unpack(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepInputs:
    _, t, b, w, r, _ = header.tolist()
    payload = payload.to(device)
    parts = payload.split([t, t, t, b * w, b, b + 1, r])
    return StepInputs(parts[0], parts[1], parts[2], parts[3].view(b, w), parts[4], parts[5], parts[6])
