"""Draft-model proposer: a small model with the target's tokenizer drafts K tokens, one pass per token.

The draft keeps its own KV cache (its own block pool), its own parallel degree (always 1 here, never the
target's: the reference study measured a 2.7x slowdown when a small draft was forced to TP=4) and a shadow
sequence per target sequence. Each step it catches up on the tokens the target accepted since last time
(KV of rejected drafts is dropped by keeping only the common prefix), then drafts greedily for a greedy
target, or samples from its own distribution (returned for the rejection rule) when the target samples.
"""

from __future__ import annotations

import dataclasses

import torch

from leverlab.core.block_manager import BlockManager
from leverlab.core.scheduler import ScheduledBatch
from leverlab.core.sequence import Sequence
from leverlab.errors import UnsupportedLever
from leverlab.speculative.base import Draft
from leverlab.worker.model_runner import ModelRunner
from leverlab.worker.sampler import probabilities


class DraftModelProposer:
    needs_features = False

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.shadows: dict[int, Sequence] = {}

    @classmethod
    def from_config(cls, spec, engine_config, max_model_len: int) -> DraftModelProposer:
        if not spec.model:
            raise UnsupportedLever('speculative method "draft_model" needs "model": the draft model folder')
        quantization = {"auto": engine_config.quantization, "none": None}.get(spec.quantization, spec.quantization)
        cfg = dataclasses.replace(engine_config, model=spec.model, speculative_config=None, num_kv_blocks=None,
                                  enable_prefix_caching=False, quantization=quantization)
        runner = ModelRunner(cfg, spec.model, max_model_len)
        if runner.model_config.max_position_embeddings < max_model_len:
            raise UnsupportedLever(f"draft model {spec.model} handles {runner.model_config.max_position_embeddings} "
                                   f"positions, fewer than the target's max_model_len {max_model_len}")
        runner.warmup()
        return cls(runner)

    def check_vocab(self, target_vocab: int) -> None:
        if self.runner.model_config.vocab_size != target_vocab:
            raise UnsupportedLever(f"draft vocabulary ({self.runner.model_config.vocab_size}) differs from the "
                                   f"target's ({target_vocab}): a draft must share the target's tokenizer")

    def attach(self, runner) -> None:
        pass  # the draft has its own runner

    def observe(self, result) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.release(shadow)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        active: list[tuple[int, Sequence, int]] = []  # (index in seqs, shadow, k)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k > 0 and (shadow := self._sync(seq, k)) is not None:
                active.append((i, shadow, k))
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
        step = 0
        while active:
            # First pass: each shadow catches up on what the target accepted; later passes: one token each.
            batch = ScheduledBatch([s for _, s, _ in active],
                                   [s.num_tokens - s.num_computed_tokens for _, s, _ in active], [])
            logits = self.runner.execute(batch).logits  # one row per shadow
            for row, (i, shadow, _) in enumerate(active):
                shadow.num_computed_tokens = shadow.num_tokens
                p = seqs[i].params
                if p.greedy:
                    tok = int(logits[row].argmax())
                else:
                    q = probabilities(logits[row], p)
                    tok = int(torch.multinomial(q, 1, generator=shadow.generator))
                    probs[i].append(q)
                drafts[i].tokens.append(tok)
                shadow.prompt_token_ids.append(tok)  # the shadow's tokens run ahead of the target's
            step += 1
            active = [(i, s, k) for i, s, k in active if k > step]
        for i, qs in probs.items():
            if qs:
                drafts[i].probs = torch.stack(qs)
        return drafts

    def _sync(self, seq: Sequence, k: int) -> Sequence | None:
        """The shadow of seq, holding valid KV for the longest prefix it shares with seq's tokens now."""
        tokens = seq.prompt_token_ids + seq.output_token_ids
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            gen = None
            if not seq.params.greedy:
                seed = seq.params.seed
                seed = (seed ^ 0x5EED) + seq.index if seed is not None else int(torch.randint(0, 2**62, (1,)))
                gen = torch.Generator().manual_seed(seed)
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, [], seq.params, gen)
            self.shadows[seq.seq_id] = shadow
        common = 0
        for a, b in zip(shadow.prompt_token_ids, tokens):
            if a != b:
                break
            common += 1
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, len(tokens) - 1)
        shadow.prompt_token_ids = list(tokens)
        # Slots for every token, plus the k - 1 drafts that are fed back in.
        if not self.blocks.can_grow(shadow, len(tokens) + k - 1):
            return None  # the draft's pool is full: this sequence goes without drafts this step
        self.blocks.grow(shadow, len(tokens) + k - 1)
        return shadow
