"""The speculation gate (`adaptive: true`): per batch-size bucket, speculate only where it measurably pays.

No cost model. Two arms per bucket: speculate (K = num_speculative_tokens) or plain decoding. Each arm's
throughput is measured on the engine's own decode-only steps (tokens emitted / whole-step seconds, drafting,
verification and output included), as the median of its last WINDOW steps: on a shared machine a step now
and then takes several times its usual time (another process got the core), and a mean would let one such
step flip the decision for a long while. The bucket runs the better arm; every PROBE_EVERY of its steps it
runs the other arm for RUN steps, so the comparison follows changes in acceptance (a different workload) and
in cost (other load on the machine), and the acceptance statistics stay fresh. A new bucket first measures
both arms RUN times each (for a bounded number of steps); an arm with no measurement yet counts as slower.
A wrong foretelling (capture_next) costs one step's capture or one step's drafts, never a token: those
steps are left out of the measurements.

Why it cannot lose much: while the gate is shut a step is a plain step (no drafting, no feature capture, no
aux output: the decoder switches the runner's capture off), and the losing arm only runs RUN of every
PROBE_EVERY + RUN steps. A proposer that drafts from features (EAGLE) needs the step before a speculating run
to capture them: that step is plain but captures (`capture_next`).

Buckets: round(log2(decoding sequences)), so 6-11 sequences share one (a batch drifts by one or two as
requests come and go under continuous arrivals).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 16


@dataclass
class _Arm:
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # tokens/s of its last steps
    samples: int = 0
    rate: float = 0.0  # median of `recent` (0 before any step: an unmeasured arm counts as slower)

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append(tokens / seconds)
        self.samples += 1
        self.rate = statistics.median(self.recent)


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    steps: int = 0  # decisions made in this bucket
    run_arm: bool | None = None  # the arm of the run in progress (probe or first tries)
    run_left: int = 0
    last_arm: bool | None = None  # the latest decision
    spec_streak: int = 0  # speculating decisions in a row, the latest included

    def best(self) -> bool:
        return self.arms[True].rate > self.arms[False].rate


class ThroughputGate:
    RUN = 4  # measured steps per probe run (and per first try)
    PROBE_EVERY = 48  # steps of the winning arm between probe runs of the other
    # A head drafting from features (EAGLE) has seen none while the gate was shut: its first drafts after that
    # gap come from little recent context and are accepted less often than in a steady speculating stretch.
    # The first WARM speculating steps after plain ones are therefore run but not measured.
    WARM = 2
    LEAD = 8  # plain steps before a speculating run that capture features for it (EAGLE)

    def __init__(self, needs_capture: bool):
        self.needs_capture = needs_capture
        self.warm = self.WARM if needs_capture else 0
        self.run = self.RUN + self.warm  # steps per speculating run
        # Decisions between probe starts: longer runs are started less often, so the losing arm keeps
        # about the same share of steps (RUN / (PROBE_EVERY + RUN), 8%) either way.
        self.period = (self.PROBE_EVERY + self.RUN) * self.run // self.RUN
        self.buckets: dict[int, _Bucket] = {}
        self.acceptance = 0.5  # running share of drafted tokens accepted (per position tried)
        self.steps = {True: 0, False: 0}  # steps run per arm (exported as counters)

    @staticmethod
    def bucket_of(num_seqs: int) -> int:
        return round(math.log2(max(1, num_seqs)))

    def _next_run(self, b: _Bucket, steps: int, pending: bool | None = None) -> bool | None:
        """The arm a run starting at decision number `steps` would take (None: no run, follow the best).
        pending: the arm of a step decided but not measured yet (capture_next looks one step ahead)."""
        if steps <= 16 * self.RUN:  # a new bucket first measures each arm RUN times (steps that prefill
            for arm in (True, False):  # do not count, hence a bound rather than a fixed schedule)
                if b.arms[arm].samples + (pending is arm) < self.RUN:
                    return arm
        return (not b.best()) if steps % self.period == 0 else None

    def decide(self, num_seqs: int) -> bool:
        """Speculate this step? num_seqs: decoding sequences this step. O(1): a dict lookup and counters."""
        b = self.buckets.get(k := self.bucket_of(num_seqs))
        if b is None:
            b = self.buckets[k] = _Bucket()
        b.steps += 1
        if b.run_left <= 0:
            b.run_arm = self._next_run(b, b.steps)
            b.run_left = 0 if b.run_arm is None else self.run if b.run_arm else self.RUN
        if b.run_arm is not None:
            b.run_left -= 1
            arm = b.run_arm
        else:
            arm = b.best()
        b.last_arm = arm
        b.spec_streak = b.spec_streak + 1 if arm else 0
        self.steps[arm] += 1
        return arm

    def capture_next(self, num_seqs: int) -> bool:
        """Should this step capture features? Yes when one of the next LEAD decisions (same bucket) will
        speculate: the head then drafts with the last LEAD positions as recent context rather than one."""
        if not self.needs_capture:
            return False
        b = self.buckets.get(self.bucket_of(num_seqs))
        if b is None:
            return True
        steps, arm, left = b.steps, b.run_arm, b.run_left
        for j in range(self.LEAD):  # the next decisions, as decide() will take them
            steps += 1
            if left <= 0:
                arm = self._next_run(b, steps, b.last_arm if j == 0 else None)
                left = 0 if arm is None else self.run if arm else self.RUN
            if arm is not None:
                left -= 1
                if arm:
                    return True
            elif b.best():
                return True
        return False

    def observe_step(self, num_seqs: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step's outcome (tokens emitted over all sequences, whole-step seconds). The decoder
        leaves out steps that do not show an arm as it is: a speculating step that found no drafts, and a
        plain step that captured features for the next."""
        b = self.buckets.get(self.bucket_of(num_seqs))
        if b is None or seconds <= 0 or (speculated and b.spec_streak <= self.warm):
            return  # (a speculating step right after plain ones: the head is still warming up)
        b.arms[speculated].add(tokens, seconds)

    def observe_verify(self, drafted: int, accepted: int) -> None:
        tried = min(accepted + 1, drafted)
        if tried:
            self.acceptance = 0.95 * self.acceptance + 0.05 * accepted / tried

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per bucket: (speculating, plain) tokens/s as measured now."""
        return {k: (b.arms[True].rate, b.arms[False].rate) for k, b in sorted(self.buckets.items())}
