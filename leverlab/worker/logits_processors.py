"""The logits controls that can change which token is the argmax, batched over the rows that set them.

In vLLM's order (v1 sampler): allowed_token_ids (everything else -inf), bad_words (the last token of a bad
word whose other tokens just came out: -inf), logit_bias (added), then the penalties: repetition (a token
seen in the prompt or the output: a positive logit divided by it, a negative one multiplied), frequency
(minus penalty x the token's count in the output) and presence (minus penalty once the token is in the
output). min_p comes later, after temperature (sampler.probabilities): it cannot move the argmax.

Rows whose request sets none of these pay nothing: the function returns its input untouched when no row
needs it, and only the rows that do are gathered, processed and written back into a copy (the caller's
logits stay raw: logprobs are reported from them, as vLLM's default raw_logprobs mode does).

Speculative verification calls the same function with one row per drafted position, each row's output
history extended by the drafts before it, so that position j is processed exactly as plain decoding would
process it after those j tokens had been generated one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leverlab.sampling_params import SamplingParams


def apply(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
          outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [B, V]; per row its request's params, prompt ids and output ids so far. Returns `logits` itself
    when no row needs processing, else a processed copy (float32)."""
    rows = [i for i, p in enumerate(params) if p.needs_logits_processing]
    if not rows:
        return logits
    out = logits.float().clone()
    idx = torch.tensor(rows)
    sub = out.index_select(0, idx)
    ps = [params[i] for i in rows]
    _allowed_and_bad_words(sub, ps, [outputs[i] for i in rows])
    _logit_bias(sub, ps)
    _penalties(sub, ps, [prompts[i] for i in rows], [outputs[i] for i in rows])
    out.index_copy_(0, idx, sub)
    return out


def _allowed_and_bad_words(x: torch.Tensor, ps: list[SamplingParams], outputs: list[Sequence[int]]) -> None:
    vocab = x.shape[1]
    for r, p in enumerate(ps):
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = True
            x[r].masked_fill_(~keep, float("-inf"))
        for word in p.bad_words_token_ids or ():
            prefix = word[:-1]
            # the word's other tokens must be the last ones generated (vLLM compares the output only)
            if len(prefix) <= len(outputs[r]) and (not prefix or list(outputs[r][-len(prefix):]) == prefix):
                if word[-1] < vocab:
                    x[r, word[-1]] = float("-inf")


def _logit_bias(x: torch.Tensor, ps: list[SamplingParams]) -> None:
    rows, cols, vals = [], [], []
    for r, p in enumerate(ps):
        for t, b in (p.logit_bias or {}).items():
            if t < x.shape[1]:
                rows.append(r)
                cols.append(t)
                vals.append(b)
    if rows:
        x.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, dtype=x.dtype), accumulate=True)


def _penalties(x: torch.Tensor, ps: list[SamplingParams], prompts: list[Sequence[int]],
               outputs: list[Sequence[int]]) -> None:
    pen = [r for r, p in enumerate(ps) if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
    if not pen:
        return
    n, vocab = len(pen), x.shape[1]
    sel = torch.tensor(pen)
    counts = _bin_counts([outputs[r] for r in pen], vocab)  # [n, V]
    seen_out = counts > 0
    y = x.index_select(0, sel)
    rep = torch.tensor([ps[r].repetition_penalty for r in pen], dtype=y.dtype)
    if bool((rep != 1.0).any()):
        seen = seen_out | (_bin_counts([prompts[r] for r in pen], vocab) > 0)
        factor = torch.where(seen, rep[:, None].expand(n, vocab), torch.ones((), dtype=y.dtype))
        y = torch.where(y > 0, y / factor, y * factor)
    freq = torch.tensor([ps[r].frequency_penalty for r in pen], dtype=y.dtype)[:, None]
    pres = torch.tensor([ps[r].presence_penalty for r in pen], dtype=y.dtype)[:, None]
    y = y - freq * counts.to(y.dtype) - pres * seen_out.to(y.dtype)
    x.index_copy_(0, sel, y)


def _bin_counts(seqs: list[Sequence[int]], vocab: int) -> torch.Tensor:
    """[len(seqs), vocab] int counts of each token id in each sequence (ids outside the vocabulary dropped)."""
    longest = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), longest), vocab, dtype=torch.long)  # padding lands in the extra column
    for r, s in enumerate(seqs):
        if s:
            ids[r, : len(s)] = torch.as_tensor(list(s), dtype=torch.long).clamp_(0, vocab)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.long)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]
