"""The speculation gate (`adaptive: true`): per batch-size bucket, speculate only where it measurably pays.

No cost model. Two arms per bucket: speculate (K = num_speculative_tokens) or plain decoding. Each arm's
throughput is measured on the engine's own decode-only steps (tokens emitted / whole-step seconds, drafting,
verification and output included), over its last WINDOW steps: their tokens over their seconds, each step's
seconds capped at OUTLIER times the median step (on a shared machine a step now and then takes several times
its usual time: another process got the core, and one such step must not flip the decision). WINDOW is long
because a speculating arm's yield varies from step to step: over 16 steps a 3-tokens-a-step n-gram arm read
below a 2-token plain one often enough to stay shut for hundreds of steps. The bucket runs the better arm; now
and then it runs the other arm for RUN steps (a probe), so the comparison follows changes in acceptance (a
different workload) and in cost (other load on the machine), and the acceptance statistics stay fresh. How
often is set by what a probe costs, as measured: the time a probe run loses against the better arm (and, for
EAGLE, the extra time of the plain steps that capture features for it) is kept to BUDGET of the time between
probes, so a loser far behind is probed seldom (at most every MAX_PERIOD decisions) and one close behind about
every PROBE_EVERY. A new bucket first measures both arms RUN times each (for a bounded number of steps); an arm
with no measurement yet counts as slower; where a neighbouring bucket has measured both arms, only its better
arm is tried first, and the other is first probed after a wait set by that bucket's margin where the verdict
carries over (plain decoding that won at a smaller batch, speculating that won at a larger one: `_prior`), else
after the shortest wait (a burst of requests, such as the study's one wave of 16, is over before an even split
between the arms would have paid for itself). Those first tries run where the bucket began, at the start of its
requests' outputs, which can be unlike the rest, so the first probe comes soon after them (SECOND_LOOK) and
measures the probed arm afresh.
A wrong foretelling (capture_next) costs one step's capture or one step's drafts, never a token: those
steps are left out of the measurements.

Why it cannot lose much: while the gate is shut a step is a plain step (no drafting, no feature capture, no
aux output: the decoder switches the runner's capture off), and probing the losing arm is held to BUDGET of
the time by its measured cost (at most RUN of every PROBE_EVERY + RUN steps). A proposer that drafts from
features (EAGLE) needs the steps before a speculating run to capture them: those steps are plain but capture
(`capture_next`), and are measured apart (what a probe costs), not as the plain arm.

Buckets: the number of decoding sequences itself up to EXACT (16), then quarter octaves (17-20, 21-23, ...).
Not wider: a step's cost and yield move with its sequences, and within a bucket the two arms are not measured
at the same sizes (a speculating stretch leaves a batch ragged, so its arm has more steps at 6-7 sequences of a
c=8 wave than the plain one). Measured on the bundled model (n-gram, K=4, c=8, one thread): at 8 sequences
plain decoding ran 2497 tok/s and speculating 2367, at 7 2464 and 2670; the old bucket of 6-11 sequences
pooled them into 2490 for speculating against 2400 for plain, and the gate speculated through most of a c=8
wave that plain decoding ran faster. A batch that drifts by one or two under continuous arrivals meets a few
neighbouring buckets; each starts from its nearest measured neighbour's better arm (the prior, above).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 64
BUDGET = 0.015  # the share of a bucket's time that probing the losing arm may cost
MAX_PERIOD = 2048  # decisions between probes, at most (acceptance and cost still get re-measured)
OUTLIER = 2.0  # a step counts at most this many median step times in an arm's throughput
EXACT = 16  # up to this many decoding sequences, each batch size is a bucket of its own
# Speculating counts as the better arm only when it beats plain decoding by more than this share. A near tie goes
# to plain decoding: speculating costs what its steps' rates do not show (a wave of requests that speculates
# finishes ragged, its last sequences running in ever smaller steps: with fixed-K n-gram at c=8, 28 of a
# generation's 57 steps and 30% of its time), and two arms within the noise of their windows had traded places
# every few probes (n-gram at 8 sequences, 6% apart: whole waves speculating). bench_spec, two runs of 8 repeats
# each: adaptive n-gram 0.98-0.99x of plain decoding at c=8 with it, 0.94x and 1.01x in two runs without.
TIE = 0.03


@dataclass
class _Arm:
    tokens: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # tokens emitted by its last steps
    seconds: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # and their durations, capped
    samples: int = 0
    rate: float = 0.0  # tokens/s over the window (0 before any step: an unmeasured arm counts as slower)
    step_s: float = 0.0  # median of `seconds`

    def add(self, tokens: int, seconds: float) -> None:
        """Throughput is the window's tokens over its seconds, not a median of per-step rates: a speculating
        step's yield is skewed (most n-gram steps accept nothing, a few accept K), and a median of
        tokens/seconds reads it low (a 60/40 mix of 1 and 6 tokens a step as 1). A step's seconds count at
        most OUTLIER times the median step as it stood, so a step that lost the core to another process moves
        the rate by a share of the window, not by its whole length."""
        if self.step_s > 0:
            seconds = min(seconds, OUTLIER * self.step_s)
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        self.samples += 1
        if self.samples <= 16 or self.samples % 4 == 0:  # the median of 64 moves slowly: not every step
            self.step_s = statistics.median(self.seconds)
        total = sum(self.seconds)
        self.rate = sum(self.tokens) / total if total > 0 else 0.0


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    capture: _Arm = field(default_factory=_Arm)  # plain steps that captured features for a speculating run
    steps: int = 0  # decisions made in this bucket
    last_probe: int = 0  # the decision at which the latest probe run started (0: none yet)
    tried: int = 0  # the decision at which both arms had their first RUN measured steps (0: not yet)
    prior: bool | None = None  # the nearest measured bucket's better arm when this one began (None: none)
    prior_wait: int = 0  # with a prior: the decision at which the other arm is first tried
    looked: bool = False  # the first probe after both arms were measured has started (it measures afresh)
    run_arm: bool | None = None  # the arm of the run in progress (probe or first tries)
    run_left: int = 0
    last_arm: bool | None = None  # the latest decision
    spec_streak: int = 0  # speculating decisions in a row, the latest included

    def best(self) -> bool:
        return self.arms[True].rate > self.arms[False].rate * (1 + TIE)


class ThroughputGate:
    RUN = 4  # measured steps per run, probe or first try (a plain run's last is not where it captures for EAGLE)
    PROBE_EVERY = 48  # steps of the winning arm between probe runs of the other, at least
    # A head drafting from features (EAGLE) has seen none while the gate was shut: its first drafts after that
    # gap come from little recent context and are accepted less often than in a steady speculating stretch.
    # The first WARM speculating steps after plain ones are therefore run but not measured.
    WARM = 2
    LEAD = 8  # plain steps before a speculating run that capture features for it (EAGLE)
    # The first probe comes SECOND_LOOK decisions after the first tries, not a whole period: a new bucket's first
    # few speculating steps can read low for reasons that pass (an n-gram arm before the output repeats itself),
    # and following the other arm for a period on that had cost the first 128-token generation at c = 1 most of
    # its speculation (65 plain steps of 89 where speculating ran 1.3-1.9x plain decoding).
    SECOND_LOOK = 16

    def __init__(self, needs_capture: bool):
        self.needs_capture = needs_capture
        self.warm = self.WARM if needs_capture else 0
        self.run = self.RUN + self.warm  # steps per speculating run
        # Decisions between probe starts, at least: longer runs are started less often, so the losing arm
        # keeps at most the same share of steps (RUN / (PROBE_EVERY + RUN), 8%) either way. probe_period()
        # stretches it where a probe costs more than BUDGET of that.
        self.period = (self.PROBE_EVERY + self.RUN) * self.run // self.RUN
        self.first_tries = 16 * self.RUN  # decisions within which a new bucket's first tries may fall
        self.buckets: dict[int, _Bucket] = {}
        self.acceptance = 0.5  # running share of drafted tokens accepted (per position tried)
        self.steps = {True: 0, False: 0}  # steps run per arm (exported as counters)

    @staticmethod
    def bucket_of(num_seqs: int) -> int:
        """num_seqs itself up to EXACT, then quarter octaves above it (keys keep the sizes' order)."""
        n = max(1, num_seqs)
        return n if n <= EXACT else EXACT + max(1, round(4 * math.log2(n / EXACT)))

    def _next_run(self, b: _Bucket, steps: int, pending: bool | None = None) -> tuple[bool | None, bool]:
        """The arm a run starting at decision number `steps` would take (None: no run, follow the best), and
        whether that run is a probe. pending: the arm of a step decided but not measured yet (capture_next looks
        one step ahead)."""
        if steps <= self.first_tries:  # a new bucket first measures each arm RUN times (steps that prefill do
            # not count, hence a bound rather than a fixed schedule); with a prior, only the prior's arm
            for arm in (True, False) if b.prior is None else (b.prior,):
                if b.arms[arm].samples + (pending is arm) < self.RUN:
                    return arm, False
        if steps >= b.last_probe + self.probe_period(b):
            return not b.best(), True
        return None, False

    def _prior(self, k: int) -> tuple[bool | None, int]:
        """A new bucket's prior: the better arm of the nearest bucket whose arms are both measured (the smaller
        batch on a tie), and the decision at which to first try the other arm, from that bucket's margin by
        probe_period's rule (a run of the loser costs about BUDGET of the time before it), between SECOND_LOOK
        and `period`.
        Only where the neighbour's verdict carries over: speculating pays less the more sequences share a step
        (each verifies K + 1 rows where plain decoding computes one), so plain decoding that won at a smaller
        batch wins at this larger one, and speculating that won at a larger batch wins at this smaller one. The
        other way round says little: speculating won by 19% at 4 sequences with EAGLE and lost by 35% at 8
        (bundled model), and following it for its 43-decision wait had run the first two c=8 waves of
        bench_spec speculating throughout (0.73-0.80x of plain decoding, median of the waves). Then the
        neighbour's arm still goes first (n-gram speculation that wins at 1 sequence mostly wins at 4 and 16
        too, and a server's short burst has no time to measure both), but the other is tried after the shortest
        wait, SECOND_LOOK."""
        near = sorted((abs(j - k), j) for j, b in self.buckets.items() if b.tried)
        if not near:
            return None, 0
        j = near[0][1]
        b = self.buckets[j]
        best = b.best()
        if best == (j < k):  # speculating won at fewer sequences, or plain decoding at more
            return best, self.SECOND_LOOK
        win, lose = b.arms[best].rate, b.arms[not best].rate
        lost = self.RUN * max(0.0, 1 - lose / win) if win > 0 else 0.0
        return best, int(min(self.period, max(self.SECOND_LOOK, lost / BUDGET)))

    def probe_period(self, b: _Bucket) -> int:
        """Decisions from one probe run's start to the next, so that probing costs about BUDGET of the time.
        A probe of the loser runs `run` of its steps, each losing (1 - its rate / the winner's) of its time; a
        speculating probe also has LEAD plain steps before it that capture features, each costing what a
        capturing step takes over a plain one.
        Taken from the measurements as they are at each decision: the probe that just ran counts. The first
        probe comes SECOND_LOOK decisions after the first tries (with a prior, at prior_wait; `period` after the
        bucket's start if they never completed) whatever they measured: a few unrepresentative steps (an n-gram
        arm before the output repeats itself) must not shut a bucket for long."""
        if b.last_probe == 0:  # (absolute decision numbers: last_probe is 0)
            if b.tried:
                return b.tried + self.SECOND_LOOK
            return b.prior_wait if b.prior is not None else self.period
        best = b.best()
        win, lose = b.arms[best], b.arms[not best]
        if not (win.rate > 0 and lose.rate > 0 and win.step_s > 0):
            return self.period
        lost = (self.run if not best else self.RUN) * lose.step_s * max(0.0, 1 - lose.rate / win.rate)
        if not best and self.needs_capture and b.capture.samples:
            lost += self.LEAD * max(0.0, b.capture.step_s - win.step_s)
        return int(min(MAX_PERIOD, max(self.period, lost / (BUDGET * win.step_s))))

    def decide(self, num_seqs: int) -> bool:
        """Speculate this step? num_seqs: decoding sequences this step. O(1): a dict lookup and counters."""
        b = self.buckets.get(k := self.bucket_of(num_seqs))
        if b is None:
            prior, wait = self._prior(k)
            b = self.buckets[k] = _Bucket(prior=prior, prior_wait=wait)
        b.steps += 1
        if not b.tried and all(a.samples >= self.RUN for a in b.arms.values()):
            b.tried = b.steps
        if b.run_left <= 0:
            b.run_arm, probe = self._next_run(b, b.steps)
            b.run_left = 0 if b.run_arm is None else self.run if b.run_arm else self.RUN
            if probe:
                if b.tried and not b.looked:
                    # The first probe after both arms were measured measures its arm afresh: the first tries
                    # ran where the bucket began, at the start of its requests' outputs, which can be unlike the
                    # rest (the bundled EAGLE head's first 4 drafts of an output are all rejected, then ~2 of 3
                    # are accepted).
                    b.arms[b.run_arm] = _Arm()
                    b.looked = True
                b.last_probe = b.steps
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
        if b.run_left > 0:
            # In a run: a speculating one goes on; a plain one (a probe or a first try) measures plain steps, and
            # a capturing step is not one, so only its last step may capture (below) for what follows.
            return bool(b.run_arm)
        if b.steps >= self.first_tries:
            # The first tries are over: the next LEAD decisions follow the best arm until the next probe (of
            # the other) starts, at last_probe + probe_period. O(1).
            return b.best() or b.steps + self.LEAD >= b.last_probe + self.probe_period(b)
        steps, arm, left = b.steps, b.run_arm, b.run_left
        for j in range(self.LEAD):  # a new bucket's first tries: the next decisions, as decide() will take them
            steps += 1
            if left <= 0:
                arm, _ = self._next_run(b, steps, b.last_arm if j == 0 else None)
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

    def observe_capture(self, num_seqs: int, seconds: float) -> None:
        """A decode-only plain step that captured features for a coming speculating run (what it costs)."""
        b = self.buckets.get(self.bucket_of(num_seqs))
        if b is not None and seconds > 0:
            b.capture.add(num_seqs, seconds)

    def observe_verify(self, drafted: int, accepted: int) -> None:
        tried = min(accepted + 1, drafted)
        if tried:
            self.acceptance = 0.95 * self.acceptance + 0.05 * accepted / tried

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per bucket: (speculating, plain) tokens/s as measured now."""
        return {k: (b.arms[True].rate, b.arms[False].rate) for k, b in sorted(self.buckets.items())}
