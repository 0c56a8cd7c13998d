"""CPU time the hypervisor gave to other guests while we ran: the steal counter of /proc/stat.

Why: on a shared virtual machine a benchmark's figures move with its neighbours. In one measured run the steal counter
gained up to ~5% of both vCPUs' time in a few minutes. A rate measured in such a spell says more about the host than
about the engine; a benchmark that records the steal share beside each block lets its reader discount those blocks
instead of guessing. (The host can also run two vCPUs on one core's two hyperthreads, which steal does not count:
study/bandwidth.py thread_scaling measures that.)
"""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_ticks(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(steal ticks, all ticks) summed over the CPUs since boot, or None where there is no such file (not Linux)
    or it has no steal column (kernels before 2.6.11)."""
    try:
        line = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = line.split()
    # "cpu user nice system idle iowait irq softirq steal guest guest_nice": guest time is also counted in user
    # (and guest_nice in nice), so the total is the first eight.
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)


class StealMeter:
    """The steal share of all CPU time between construction and share()."""

    def __init__(self, path: Path = PROC_STAT):
        self.path = path
        self.t0 = cpu_ticks(path)

    def share(self) -> float | None:
        """Steal ticks over all ticks since construction, 0..1; None where not measurable or no tick has passed."""
        t1 = cpu_ticks(self.path)
        if self.t0 is None or t1 is None or t1[1] <= self.t0[1]:
            return None
        return (t1[0] - self.t0[0]) / (t1[1] - self.t0[1])
