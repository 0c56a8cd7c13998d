"""A sequence: one prompt and the tokens generated for it, with its place in the KV cache.

A request with n > 1 owns n sequences. Tokens are "computed" once their K/V are in the cache;
the scheduler works only with the two counters num_tokens and num_computed_tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from leverlab.outputs import PositionLogprobs
from leverlab.sampling_params import SamplingParams

if TYPE_CHECKING:
    from leverlab.structured.state import SequenceGrammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs this is
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # per-sequence RNG, so a seed gives the same text in any batch
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens being verified this step
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0  # leading blocks handed back because they fell out of a sliding window
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the full blocks registered so far
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # with logprobs: each output token's rank in the vocabulary
    cumulative_logprob: float = 0.0  # with logprobs: the sum of the output tokens' logprobs
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in the vocabulary, with prompt_logprobs
    grammar: SequenceGrammar | None = None  # structured output: the matcher this sequence's tokens follow
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:  # decode and verification: slice the outputs and drafts, never copy the whole context
            o = len(self.output_token_ids)
            s, e = start - p, end - p
            if e <= o:
                return self.output_token_ids[s:e]
            if s >= o:
                return self.spec_token_ids[s - o:e - o]
            return self.output_token_ids[s:] + self.spec_token_ids[: e - o]
        return (self.prompt_token_ids + self.output_token_ids + self.spec_token_ids)[start:end]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
