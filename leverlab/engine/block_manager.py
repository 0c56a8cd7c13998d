"""KV-cache blocks: who owns which block. The tensors themselves live in the model runner.

Invariant: len(free) + sum of blocks held by live sequences == num_blocks; nothing is ever held twice.
"""

from __future__ import annotations

from collections import deque

from leverlab.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first num_tokens tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.free.popleft())

    def release(self, seq: Sequence) -> None:
        # Returned to the front: a just-freed block is the likeliest to be warm in cache.
        self.free.extendleft(reversed(seq.block_table))
        seq.block_table = []

    def check(self, live: list[Sequence]) -> None:
        held = [b for s in live for b in s.block_table]
        assert len(held) == len(set(held)), "a block is held twice"
        assert len(held) + len(self.free) == self.num_blocks, "blocks leaked"
