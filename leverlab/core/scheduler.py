"""Continuous batching with a token budget, as vLLM v1 does it: no prefill or decode phase.

Every step each running sequence asks for num_tokens - num_computed_tokens more tokens (1 when decoding,
a chunk of its prompt while prefilling) and gets a slice of the budget. Running sequences go first, in
arrival order; waiting ones are admitted while budget, sequence slots and KV blocks last. When blocks run
out, the newest running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from leverlab.core.block_manager import BlockManager
from leverlab.core.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """The narrow, data-only hand-off to the model runner."""

    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens to compute this step
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def update_from_output(self, batch: ScheduledBatch, rejected: dict[int, int], window: int | None) -> None:
        """The step ran: each sequence computed its scheduled tokens, less the drafts verification rejected
        (their KV entries are stale and get overwritten). The only writer of num_computed_tokens after
        admission, as vLLM v1's update_from_output. Then full blocks become reusable prefix-cache entries
        (accepted tokens only), and with every layer sliding, blocks behind the window are freed."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - rejected.get(seq.seq_id, 0)
            self.blocks.commit_full_blocks(seq)
            if window:
                self.blocks.release_before(seq, seq.num_computed_tokens - window + 1)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.budget
        batch = ScheduledBatch([], [], [])
        running = list(self.running)
        while running:
            seq = running.pop(0)
            wanted = seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens
            n = min(wanted, budget)
            if n <= 0:
                continue
            if n < wanted and seq.spec_token_ids:  # drafts that do not fit the budget are dropped
                seq.spec_token_ids = seq.spec_token_ids[: max(0, len(seq.spec_token_ids) - (wanted - n))]
            if seq.spec_token_ids and not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                n -= len(seq.spec_token_ids)  # speculation never costs a preemption: drop the drafts first
                seq.spec_token_ids = []
            # Make room: preempt the newest running sequences (possibly this one) until the blocks fit.
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = running.pop() if running else seq
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        # Admit waiting sequences in order; never overtake one that does not fit (no starvation).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_computed_tokens = self.blocks.match_prefix(seq)  # reuse cached prompt blocks
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                self.blocks.release(seq)  # give the matched blocks back until it fits
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's KV and requeue it at the front."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    @property
    def live(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
