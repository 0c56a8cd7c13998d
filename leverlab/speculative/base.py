"""The proposer interface and registry. Adding a speculative method is adding a file and a line here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from leverlab.core.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), V] the draft's own distribution at each position, for the rejection rule when the
    # target samples; None for deterministic drafts (n-gram, or greedy drafting for a greedy target).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Everything the engine's SpecDecoder calls; no method is optional (no hasattr probing)."""

    # Drafts from the target's features (EAGLE): the runner must return the aux layers' outputs on the steps
    # before drafting, and observe() receives them.
    needs_features: bool

    def check_vocab(self, target_vocab: int) -> None:
        """Refuse (UnsupportedLever) a draft whose token ids cannot be the target's."""
        ...

    def attach(self, runner) -> None:
        """Called once with the target's model runner (EAGLE shares its embedding and lm_head)."""
        ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens continuing seqs[i] (prompt + output so far)."""
        ...

    def observe(self, result) -> None:
        """After verification, on steps that captured features: the target's aux rows (StepLogits)."""
        ...

    def release(self, seq: Sequence) -> None:
        """seq finished, was aborted or preempted: drop any state (KV blocks) kept for it."""
        ...


PROPOSERS = {
    "ngram": "leverlab.speculative.ngram:NgramProposer",
    "draft_model": "leverlab.speculative.draft_model:DraftModelProposer",
    "eagle": "leverlab.speculative.eagle:EagleProposer",
    "eagle3": "leverlab.speculative.eagle:EagleProposer",
}


def build_proposer(spec, engine_config, max_model_len: int) -> Proposer:
    module, _, cls = PROPOSERS[spec.method].partition(":")
    return getattr(importlib.import_module(module), cls).from_config(spec, engine_config, max_model_len)
