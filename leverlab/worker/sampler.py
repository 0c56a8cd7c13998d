"""Turn logits into tokens: the logits controls (logits_processors), greedy, temperature, min-p, top-k, top-p,
per-sequence RNG; logprobs on request."""

from __future__ import annotations

import torch

from leverlab.core.sequence import Sequence
from leverlab.outputs import PositionLogprobs
from leverlab.sampling_params import SamplingParams
from leverlab.structured.masking import mask_batch
from leverlab.worker import logits_processors


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...],
           argmax: list[int] | None = None) -> list[int]:
    """logits [B, V] float32, one row per sequence that needs a token. Returns one token id per row.
    argmax: each row's argmax when the caller has it already (the fused step computes it with the logits)."""
    # Structured output: rows outside their grammar get -inf (in place); a token the grammar forces is taken
    # without a draw, so jump-forward (which appends it without a pass) gives the same tokens. The argmax is
    # handed over only when greedy tokens will come from it (nothing below changes the logits): then a greedy row
    # without logprobs gets its token under the grammar without its row being masked.
    plain = argmax is not None and not any(s.params.needs_logits_processing or _in_min_tokens(s) for s in seqs)
    masking = mask_batch(logits, seqs, argmax if plain else None)
    forced = None
    if masking is not None:
        forced, argmax = masking
    masked = _apply_min_tokens(logits, seqs, eos_ids)
    masked = logits_processors.apply(masked, [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                                     [s.output_token_ids for s in seqs])
    greedy = argmax if argmax is not None and masked is logits else masked.argmax(dim=-1).tolist()
    logits = masked
    tokens = []
    for row, seq in enumerate(seqs):
        if seq.params.greedy:
            tokens.append(greedy[row])
        elif forced and row in forced:
            tokens.append(forced[row])
        else:
            tokens.append(int(torch.multinomial(probabilities(logits[row], seq.params), 1, generator=seq.generator)))
    return tokens


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from: [V] logits -> [V] probabilities after
    temperature, min-p, top-k and top-p (vLLM's order). Speculative verification uses the same function, so
    both agree. `logits` has already been through logits_processors.apply where the request needs it."""
    x = logits / p.temperature
    if p.min_p > 0.0:
        # min-p: drop tokens less likely than min_p times the most likely one (after temperature)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        # Overflowing logits (a model gone wrong): fall back to the argmax rather than kill the step.
        probs = torch.zeros_like(probs)
        probs[int(torch.nan_to_num(logits, nan=float("-inf")).argmax())] = 1.0
    return probs


def _in_min_tokens(seq: Sequence) -> bool:
    """Whether the sequence is still short of its min_tokens (its end tokens are banned this step)."""
    return len(seq.output_token_ids) < seq.params.min_tokens


def _apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Before min_tokens are out, end-of-sequence and stop tokens cannot be picked."""
    rows = [i for i, s in enumerate(seqs) if _in_min_tokens(s)]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        banned = list(seqs[i].params.stop_token_ids) + ([] if seqs[i].params.ignore_eos else list(eos_ids))
        banned = [t for t in banned if t < logits.shape[1]]
        if banned:
            logits[i, banned] = float("-inf")
    return logits


def token_ranks(logits: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """logits [N, V]; chosen [N]: each chosen token's 1-based rank in its row (vLLM's count: the tokens at least
    as likely, itself included). On the raw logits: the rank is the same as on the logprobs."""
    logits = logits.float()
    return (logits >= logits.gather(1, chosen[:, None])).sum(dim=-1).tolist()


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, ns: list[int]) -> list[PositionLogprobs]:
    """logits [N, V]; chosen [N]; ns[r] top alternatives for row r.
    For each row: {token: logprob}, the chosen token first, then the top ns[r] (the chosen one may be among them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
    n = max(ns, default=0)
    if n > 0:
        vals, idx = logp.topk(n, dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
    out: list[PositionLogprobs] = []
    for r, tok in enumerate(chosen.tolist()):
        d = {tok: picked[r]}
        for t, v in zip(idx[r][: ns[r]], vals[r][: ns[r]]) if n > 0 else ():
            d.setdefault(t, v)
        out.append(d)
    return out
