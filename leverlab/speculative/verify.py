"""Verification: which drafted tokens the target accepts, so that output follows the target exactly.

Greedy: accept drafts while each equals the target's argmax; then emit the target's own next token.
Sampling (the standard rejection rule, Leviathan et al. / Chen et al.): accept draft x with probability
min(1, p(x) / q(x)); on rejection, sample from the residual max(0, p - q) renormalized. With n-gram
drafts q is a point mass on x, so acceptance is p(x) and the residual is p with x removed. Either way the
emitted tokens are distributed exactly as the target's.
"""

from __future__ import annotations

import torch

from leverlab.core.sequence import Sequence
from leverlab.worker import logits_processors
from leverlab.worker.sampler import probabilities


def verify(seq: Sequence, logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None = None) -> list[int]:
    """logits [k + 1, V] for the positions after the last token and after each draft -> emitted tokens
    (the accepted drafts plus one token from the target: 1 .. k + 1 tokens).
    Row j is processed (penalties, bias, bad words, ...) with the drafts before it as generated output, as
    plain decoding would process it after emitting them one by one."""
    p = seq.params
    if p.needs_logits_processing:
        k1 = len(drafts) + 1
        history = [seq.output_token_ids + drafts[:j] for j in range(k1)]
        logits = logits_processors.apply(logits, [p] * k1, [seq.prompt_token_ids] * k1, history)
    if p.greedy:
        target = logits.argmax(dim=-1).tolist()
        out = []
        for j, d in enumerate(drafts):
            if d != target[j]:
                break
            out.append(d)
        out.append(target[len(out)])
        return out
    out = []
    for j, d in enumerate(drafts):
        probs = probabilities(logits[j], p)
        q = draft_probs[j] if draft_probs is not None else None
        accept_p = probs[d].item() if q is None else min(1.0, (probs[d] / q[d].clamp_min(1e-20)).item())
        if torch.rand((), generator=seq.generator).item() < accept_p:
            out.append(d)
            continue
        if q is None:
            residual = probs.clone()
            residual[d] = 0.0
        else:
            residual = (probs - q).clamp_min(0.0)
        if residual.sum() <= 0:
            residual = probs
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=seq.generator)))
        return out
    probs = probabilities(logits[len(drafts)], p)
    out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return out
