"""The three calls the step loop makes for structured output (each a no-op for sequences without a grammar).

  prefetch(seqs)                    before the forward: the masks are computed on a thread while the model runs
                                    (llguidance releases the GIL); returns a handle to wait on
  mask_batch(logits, seqs, argmax)  before sampling: grammar rows get -inf outside their grammar; returns the
                                    rows whose grammar allows exactly one token (taken without a draw). A
                                    greedy row without logprobs gets its token under the mask without the
                                    masked row being built (C++: one pass over the row and its bitmask)
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
from leverlab.kernels import cpu_kernels

_POOL: ThreadPoolExecutor | None = None


def prefetch(seqs: list[Sequence]) -> Future | None:
    """Start computing the current mask of every grammar sequence in `seqs` (cached on its state), off this
    thread. The caller must wait (`.result()`) before it touches those sequences' grammars again."""
    todo = [s.grammar for s in seqs if s.grammar is not None and not s.grammar.has_mask]
    if not todo:
        return None
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="leverlab-grammar")
    return _POOL.submit(_fill, todo)


def _fill(grammars) -> None:
    for g in grammars:
        g.bitmask()


@torch.inference_mode()  # the logits are inference tensors: updated in place only inside it
def mask_batch(logits: torch.Tensor, seqs: list[Sequence],
               argmax: list[int] | None = None) -> tuple[dict[int, int], list[int] | None] | None:
    """logits [B, V], one row per sequence. None when no row has a grammar (nothing done); else ({row: token}
    for the sampled rows with a single allowed token, argmax).

    argmax: each row's argmax of the unmasked logits, given only when the caller will take greedy tokens from
    it (no other processing follows). Then a greedy row without logprobs is left unmasked and the returned argmax
    holds its first maximum among the tokens its grammar allows (torch's argmax of the masked row: the same
    token). Without it every grammar row is masked in place and the returned argmax is None."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    kern = _kernels(logits)
    if argmax is not None:
        argmax = list(argmax)
        quick = [i for i in rows if seqs[i].params.greedy and seqs[i].params.logprobs is None]
        if kern is not None and quick:
            for i, t in zip(quick, kern.bitmask_argmax(logits, torch.tensor(quick), _bitmasks(seqs, quick)).tolist()):
                argmax[i] = max(t, 0)  # (-1: every allowed token at -inf, where torch's argmax says 0)
        else:  # one bit read per row; the mask is built only where the grammar refuses the argmax
            for i in quick:
                if not seqs[i].grammar.allows(argmax[i]):
                    argmax[i] = int(_masked(logits[i], seqs[i].grammar).argmax())
        rows = [i for i in rows if i not in quick]
    forced: dict[int, int] = {}
    if not rows:
        return forced, argmax
    if kern is not None:
        counts = kern.apply_bitmask_(logits, torch.tensor(rows), _bitmasks(seqs, rows)).tolist()
    else:
        banned = _fit(torch.stack([seqs[i].grammar.banned() for i in rows]), logits.shape[1])
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].masked_fill(banned, float("-inf"))
        counts = (~banned).sum(dim=1).tolist()
    for i, n in zip(rows, counts):
        s = seqs[i]
        if s.params.greedy:
            if argmax is not None:  # (logprobs asked: masked in place) its token under the mask
                argmax[i] = int(logits[i].argmax())
        elif n == 1:  # sampled, and the grammar allows one token: taken without a draw
            forced[i] = _only_token(s.grammar.bitmask())
    return forced, argmax


@torch.inference_mode()
def mask_drafts(seq: Sequence, rows: torch.Tensor, drafts: list[int]) -> None:
    """rows [k + 1, V]: the target's logits after the last token and after each draft, masked in place with the
    grammar's mask at each position. Past the first draft the grammar refuses, positions stay unmasked:
    verification never gets there (that draft has probability 0 under the mask, so it is rejected)."""
    g = seq.grammar
    if g is None:
        return
    kern = _kernels(rows)
    taken = 0
    for j in range(len(drafts) + 1):
        if kern is not None:
            kern.apply_bitmask_(rows, torch.tensor([j]), g.bitmask()[None])
        else:
            rows[j] = _masked(rows[j], g)
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


def _kernels(logits: torch.Tensor):
    """The C++ kernels when they take these logits (float32 rows of contiguous floats), else None (PyTorch)."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        return None
    return cpu_kernels.kernels()


def _bitmasks(seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """int32 [len(rows), W]: the listed sequences' current grammar bitmasks."""
    return torch.stack([seqs[i].grammar.bitmask() for i in rows])


def _masked(row: torch.Tensor, g) -> torch.Tensor:
    """A copy of one row of logits [V] with -inf where grammar state g does not allow the token."""
    return row.masked_fill(_fit(g.banned()[None], row.shape[0])[0], float("-inf"))


def _only_token(bitmask: torch.Tensor) -> int:
    """The one token a bitmask with a single bit set allows."""
    w = int(bitmask.nonzero()[0, 0])
    return 32 * w + ((int(bitmask[w]) & 0xFFFFFFFF).bit_length() - 1)


def _fit(banned: torch.Tensor, vocab: int) -> torch.Tensor:
    """The banned-token mask [B, 32 W] cut to the logits' width, or padded with True (banned) up to it."""
    if banned.shape[1] >= vocab:
        return banned[:, :vocab]
    return torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
