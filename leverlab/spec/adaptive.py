"""Adaptive speculation: choose K per sequence and per step (0 included) so speculation pays for itself.

A step that computes T tokens costs about c0 + c1*T: c0 is reading the weights once (what decode is bound
by), c1 the compute per token, which a CPU pays early. Both are fitted online from measured times of whole
engine steps (drafting, the target's pass and verification), so c1 also carries what each drafted token costs
the proposer (a draft model's or EAGLE head's passes) and the bookkeeping.
A sequence whose drafts are accepted with probability a (per position) emits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens for k drafts. K values are raised one at a time, where the marginal
tokens a^(k+1) per marginal cost c1 beat the current tokens per second, so under load (large T) K falls to 0.

Freshness: acceptance is only measured while speculating, so after a stretch with K = 0 everywhere one
sequence is given K = 1 every PROBE_EVERY steps, and estimates decay toward the global rate.
"""

from __future__ import annotations

from collections import deque


class AdaptiveK:
    PROBE_EVERY = 16

    def __init__(self, k_max: int, prior_acceptance: float = 0.5, prior_c1_over_c0: float = 0.05):
        self.k_max = k_max
        self.global_rate = prior_acceptance
        self.rates: dict[int, float] = {}  # per sequence id
        self.prior_ratio = prior_c1_over_c0
        self.steps: deque[tuple[int, float]] = deque(maxlen=256)  # (tokens computed, seconds)
        self.since_spec = 0

    # ---- measurements ------------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.steps.append((num_tokens, seconds))

    def observe_verify(self, seq_id: int, drafted: int, accepted: int) -> None:
        # Positions tried: the accepted ones, plus the one that was rejected (if any).
        tried = min(accepted + 1, drafted)
        rate = accepted / tried
        w = min(1.0, tried / 4)
        self.global_rate = 0.95 * self.global_rate + 0.05 * rate
        self.rates[seq_id] = (1 - 0.5 * w) * self.rates.get(seq_id, self.global_rate) + 0.5 * w * rate

    def forget(self, seq_id: int) -> None:
        self.rates.pop(seq_id, None)

    def cost(self) -> tuple[float, float]:
        """(c0, c1) in seconds, by least squares over recent steps; a prior ratio while T barely varied."""
        n = len(self.steps)
        if n < 4:
            return 1.0, self.prior_ratio
        mt = sum(t for t, _ in self.steps) / n
        ms = sum(s for _, s in self.steps) / n
        var = sum((t - mt) ** 2 for t, _ in self.steps)
        if var < 1e-9:
            return ms / (1 + self.prior_ratio * mt), ms * self.prior_ratio / (1 + self.prior_ratio * mt)
        c1 = sum((t - mt) * (s - ms) for t, s in self.steps) / var
        c1 = max(c1, 1e-6)
        c0 = max(ms - c1 * mt, 1e-6)
        return c0, c1

    # ---- decision ----------------------------------------------------------------------------------
    def choose(self, candidates: list[tuple[int, int]], base_tokens: int) -> list[int]:
        """candidates: (seq id, drafts available) for each decoding sequence; base_tokens: tokens the step
        computes without speculation. Returns K for each candidate."""
        c0, c1 = self.cost()
        ks = [0] * len(candidates)
        rates = [self.rates.get(sid, self.global_rate) for sid, _ in candidates]
        tokens = float(len(candidates))  # expected tokens emitted: 1 per sequence at K = 0
        time = c0 + c1 * base_tokens
        while True:
            best, gain = None, 0.0
            for i, (_, avail) in enumerate(candidates):
                if ks[i] >= min(avail, self.k_max):
                    continue
                g = rates[i] ** (ks[i] + 1)  # chance the next draft is reached and accepted
                if g > gain:
                    best, gain = i, g
            # Worth it only if the marginal tokens per second beat the step's current tokens per second.
            if best is None or gain / c1 <= tokens / time:
                break
            ks[best] += 1
            tokens += gain
            time += c1
        if any(ks):
            self.since_spec = 0
        else:
            self.since_spec += 1
            if self.since_spec >= self.PROBE_EVERY:
                for i, (_, avail) in enumerate(candidates):
                    if avail:
                        ks[i] = 1  # probe, so the acceptance estimate stays fresh
                        self.since_spec = 0
                        break
        return ks
