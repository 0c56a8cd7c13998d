"""The three calls the step loop makes for structured output (each a no-op for sequences without a grammar).

  prefetch(seqs)                    before the forward: the masks are computed on a thread while the model runs
                                    (llguidance releases the GIL); returns a handle to wait on
  mask_batch(logits, seqs)          before sampling: grammar rows get -inf outside their grammar; returns the
                                    rows whose grammar allows exactly one token (taken without a draw)
  mask_drafts(seq, rows, drafts)    before verification: the mask at each draft position, found by advancing
                                    the matcher through the drafts and rolling back; verification then
                                    accepts only what the grammar allows, so drafts stay lossless
  advance(emitted, jump_forward)    after sampling/verification: the matchers take the emitted tokens; with
                                    jump-forward the tokens the grammar then forces are appended to the
                                    emitted ones (no decode pass each: the next pass prefills them)
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from leverlab.core.sequence import Sequence

_POOL: ThreadPoolExecutor | None = None


def prefetch(seqs: list[Sequence]) -> Future | None:
    """Start computing the current mask of every grammar sequence in `seqs` (cached on its state), off this
    thread. The caller must wait (`.result()`) before it touches those sequences' grammars again."""
    todo = [s.grammar for s in seqs if s.grammar is not None and not s.grammar.has_banned]
    if not todo:
        return None
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="leverlab-grammar")
    return _POOL.submit(_fill, todo)


def _fill(grammars) -> None:
    for g in grammars:
        g.banned()


@torch.inference_mode()  # the logits are inference tensors: updated in place only inside it
def mask_batch(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, int] | None:
    """logits [B, V], one row per sequence, masked in place. None when no row has a grammar (nothing done);
    else {row: token} for the rows with a single allowed token."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    banned = _fit(torch.stack([seqs[i].grammar.banned() for i in rows]), logits.shape[1])
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
    else:
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].masked_fill(banned, float("-inf"))
    # Only sampled rows need it (greedy takes the argmax, the same token); one nonzero() for all of them.
    sampled = [j for j, i in enumerate(rows) if not seqs[i].params.greedy]
    forced = {}
    if sampled:
        sub = ~banned[sampled]
        one = (sub.sum(dim=1) == 1).nonzero()[:, 0]
        if one.numel():
            for j, tok in sub[one].nonzero().tolist():
                forced[rows[sampled[int(one[j])]]] = tok
    return forced


@torch.inference_mode()
def mask_drafts(seq: Sequence, rows: torch.Tensor, drafts: list[int]) -> None:
    """rows [k + 1, V]: the target's logits after the last token and after each draft, masked in place with the
    grammar's mask at each position. Past the first draft the grammar refuses, positions stay unmasked:
    verification never gets there (that draft has probability 0 under the mask, so it is rejected)."""
    g = seq.grammar
    if g is None:
        return
    taken = 0
    for j in range(len(drafts) + 1):
        rows[j].masked_fill_(_fit(g.banned()[None], rows.shape[1])[0], float("-inf"))
        if j == len(drafts) or g.try_accept([drafts[j]]) != 1:
            break
        taken += 1
    g.rollback(taken)


def advance(emitted: list[tuple[Sequence, list[int], torch.Tensor]], jump_forward: bool, max_model_len: int) -> None:
    """Each grammar sequence's matcher takes its emitted tokens; with jump_forward, the tokens the grammar
    forces next are appended to its emitted list (in place), up to its max_tokens and the context."""
    for seq, tokens, _ in emitted:
        g = seq.grammar
        if g is None:
            continue
        g.accept(tokens)
        if not jump_forward or tokens[-1] in g.eos_token_ids:
            continue
        p = seq.params
        n_out = len(seq.output_token_ids) + len(tokens)
        left = min((p.max_tokens if p.max_tokens is not None else max_model_len) - n_out,
                   max_model_len - seq.num_tokens - len(tokens))
        if left <= 0 or n_out < p.min_tokens:
            continue  # (before min_tokens end tokens are banned: the sampler decides, not the grammar)
        more = g.forced(left)
        if p.ignore_eos and more and more[-1] in g.eos_token_ids:
            more.pop()
        tokens.extend(more)


def _fit(banned: torch.Tensor, vocab: int) -> torch.Tensor:
    """The banned-token mask [B, 32 W] cut to the logits' width, or padded with True (banned) up to it."""
    if banned.shape[1] >= vocab:
        return banned[:, :vocab]
    return torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
