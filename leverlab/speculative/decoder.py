"""SpecDecoder: everything speculation adds to an engine step, behind five calls.

  propose(running)          before scheduling: the gate decides (adaptive), the proposer drafts, drafts go
                            into seq.spec_token_ids; the runner is told whether to capture features
  choose_tokens(result)     after the forward: sample plain sequences, verify drafted ones; returns the
                            emitted tokens and, per sequence, how many drafted positions were rejected (the
                            scheduler rolls num_computed_tokens back by that, it alone writes the counter)
  observe(result)           after the scheduler's update: hand the kept positions' features to the proposer
  end_step(batch, ...)      after the outputs: time a decode-only step for the gate
  release(seq)              a sequence ended or was preempted: drop its draft state (draft/head KV blocks)

Without a speculative config it still samples (choose_tokens) and the rest are no-ops, so the engine's step
reads the same either way. Counters (drafted, accepted, per position, gate steps) live here too.
"""

from __future__ import annotations

import time

import torch

from leverlab.core.sequence import Sequence
from leverlab.speculative.base import Proposer, build_proposer
from leverlab.speculative.gate import ThroughputGate
from leverlab.speculative.verify import verify
from leverlab.speculative_config import SpeculativeConfig
from leverlab.structured.masking import mask_drafts
from leverlab.worker.sampler import sample


class SpecDecoder:
    def __init__(self, spec: SpeculativeConfig | None, engine_config, runner, vocab_size: int,
                 eos_token_ids: tuple[int, ...], max_model_len: int):
        self.spec, self.runner = spec, runner
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.proposer: Proposer | None = None
        self.gate: ThroughputGate | None = None
        self.draft_probs: dict[int, torch.Tensor] = {}  # seq id -> the draft's distribution, when sampled
        self.counters: dict[str, float] = {}
        self.accepted_per_pos: list[int] = []
        self._t0 = 0.0
        self._arm: bool | None = None  # this step: None (no gate), True (speculating), False (plain)
        self._captured = False  # this step captures features (for the next step's drafts)
        self._n = 0  # decoding sequences this step
        if spec is None:
            return
        self.proposer = build_proposer(spec, engine_config, max_model_len)
        self.proposer.check_vocab(vocab_size)
        self.proposer.attach(runner)
        self.counters = dict(spec_draft_tokens=0, spec_accepted_tokens=0, spec_verify_steps=0)
        self.accepted_per_pos = [0] * spec.num_speculative_tokens
        if spec.adaptive:
            self.gate = ThroughputGate(needs_capture=self.proposer.needs_features)
            self.counters.update(spec_gate_spec_steps=0, spec_gate_plain_steps=0)

    # ---- before scheduling -------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Draft tokens for decoding sequences, unless the gate (or disable_by_batch_size) says not to."""
        self._t0 = time.perf_counter()
        self._arm = None
        if self.spec is None:
            return
        sc = self.spec
        if sc.disable_by_batch_size is not None and len(running) > sc.disable_by_batch_size:
            self._set_capture(False)
            return
        if self.gate is not None:
            self._n = len(running)
            self._arm = self.gate.decide(self._n)
            self.counters["spec_gate_spec_steps" if self._arm else "spec_gate_plain_steps"] += 1
            # Features are needed by the next step's drafts when it speculates; a shut gate costs nothing.
            self._set_capture(self._arm or self.gate.capture_next(self._n))
            if not self._arm:
                return
        else:
            self._set_capture(True)  # back on after a stretch above disable_by_batch_size
        seqs, ks = [], []
        for seq in running:
            p = seq.params
            if seq.num_computed_tokens != seq.num_tokens - 1 or len(seq.output_token_ids) < p.min_tokens:
                continue  # still prefilling, or end tokens are still banned (min_tokens)
            left = (p.max_tokens if p.max_tokens is not None else self.max_model_len) - len(seq.output_token_ids)
            k = min(sc.num_speculative_tokens, left - 1, self.max_model_len - seq.num_tokens)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        for seq, d in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.spec_token_ids = d.tokens
            if d.probs is not None:
                self.draft_probs[seq.seq_id] = d.probs

    def _set_capture(self, on: bool) -> None:
        self._captured = on and self.proposer.needs_features
        self.runner.set_aux_capture(on)

    # ---- after the forward -------------------------------------------------------------------------
    def choose_tokens(self, result) -> tuple[list[tuple[Sequence, list[int], torch.Tensor]], dict[int, int]]:
        """Sample each sequence's next token; verify drafted ones. Returns (sequence, emitted tokens, the
        logits rows they came from) per sequence, and per verifying sequence id the rejected drafts."""
        plain, plain_rows, plain_argmax, out, rejected, off = [], [], [], [], {}, 0
        for seq, k1 in zip(result.sample_seqs, result.rows_per_seq):
            rows, row0 = result.logits[off : off + k1], off
            off += k1
            if not seq.spec_token_ids:
                self.draft_probs.pop(seq.seq_id, None)  # drafts dropped (budget, blocks): nothing to verify
                plain.append(seq)
                plain_rows.append(rows)
                if result.argmax is not None:
                    plain_argmax.append(result.argmax[row0])
                continue
            drafts = seq.spec_token_ids
            mask_drafts(seq, rows, drafts)  # structured output: the target's rows under the grammar's masks
            tokens = verify(seq, rows, drafts, self.draft_probs.pop(seq.seq_id, None))
            accepted = len(tokens) - 1
            # KV was written for the last token and every draft; only the accepted drafts' entries are valid.
            rejected[seq.seq_id] = len(drafts) - accepted
            self.counters["spec_draft_tokens"] += len(drafts)
            self.counters["spec_accepted_tokens"] += accepted
            self.counters["spec_verify_steps"] += 1
            for j in range(accepted):
                self.accepted_per_pos[j] += 1
            if self.gate is not None:
                self.gate.observe_verify(len(drafts), accepted)
            out.append((seq, tokens, rows))
        if plain:
            # One row each: without speculation that is the whole logits tensor, as it came.
            logits = result.logits if len(plain) == len(result.logits) else torch.cat(plain_rows)
            tokens = sample(logits, plain, self.eos_token_ids, plain_argmax if result.argmax is not None else None)
            for seq, tok, rows in zip(plain, tokens, plain_rows):
                out.append((seq, [tok], rows))
        return out, rejected

    def observe(self, result) -> None:
        """After the scheduler's update: the proposer takes the features of the positions kept."""
        # Not on steps that did not mean to capture: in compiled mode the aux output stays on (one graph),
        # and fusing features nobody will draft from is exactly the cost a shut gate must not pay.
        if result.aux is not None and self.proposer is not None and self._captured:
            self.proposer.observe(result)

    def end_step(self, batch, result, emitted) -> None:
        """Time a decode-only step for the gate (a step that prefills says little about either arm)."""
        if self._arm is None or self.gate is None:
            return
        if sum(result.rows_per_seq) != batch.num_tokens:
            return  # some rows were prefill: not decode-only
        drafted = any(r > 1 for r in result.rows_per_seq)
        seconds = time.perf_counter() - self._t0
        if not self._arm and self._captured:  # a plain step that captured: part of what a probe costs
            self.gate.observe_capture(self._n, seconds)
            return
        if self._arm and not drafted and self.proposer.needs_features:
            # Not the arm as it is: a step that could not draft for want of features (the one before it did
            # not capture). An n-gram step without matches is the arm as it is.
            return
        tokens = sum(len(t) for _, t, _ in emitted)
        self.gate.observe_step(self._n, self._arm, tokens, seconds)

    def release(self, seq: Sequence) -> None:
        self.draft_probs.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(seq)

    def counter_snapshot(self) -> dict[str, float]:
        per_pos = {f"spec_accepted_pos_{j}": v for j, v in enumerate(self.accepted_per_pos)}
        return {**self.counters, **per_pos}
