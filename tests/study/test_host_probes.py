"""What the host gave a benchmark: the steal share of /proc/stat (study/steal.py), parsed from written files whose
figures are known exactly and from the real file where there is one; and the threads' compute scaling
(study/bandwidth.py thread_scaling), measured."""

from pathlib import Path

import torch

from leverlab.study.bandwidth import thread_scaling
from leverlab.study.steal import PROC_STAT, StealMeter, cpu_ticks


def stat(path: Path, user: int, steal: int, guest: int = 0) -> None:
    # cpu user nice system idle iowait irq softirq steal guest guest_nice; then a per-CPU line, which is ignored
    path.write_text(f"cpu  {user} 0 10 100 0 0 0 {steal} {guest} 0\ncpu0 1 0 0 0 0 0 0 0 0 0\n")


def test_ticks_leave_guest_time_out_of_the_total(tmp_path):
    p = tmp_path / "stat"
    stat(p, user=50, steal=40, guest=30)  # guest is part of user already
    assert cpu_ticks(p) == (40, 50 + 10 + 100 + 40)


def test_share_between_two_reads(tmp_path):
    p = tmp_path / "stat"
    stat(p, user=50, steal=40)
    meter = StealMeter(p)
    stat(p, user=80, steal=50)  # 30 user + 10 steal ticks since
    assert meter.share() == 10 / 40
    assert StealMeter(p).share() is None  # no tick since


def test_no_file_or_no_steal_column_gives_none(tmp_path):
    assert cpu_ticks(tmp_path / "absent") is None
    (tmp_path / "old").write_text("cpu  1 2 3 4\n")
    assert cpu_ticks(tmp_path / "old") is None
    assert StealMeter(tmp_path / "absent").share() is None


def test_the_real_counter_reads_where_there_is_one():
    ticks = cpu_ticks()
    if not PROC_STAT.exists():
        assert ticks is None
        return
    steal, total = ticks
    assert 0 <= steal <= total


def test_thread_scaling_is_a_ratio_and_leaves_torch_at_the_threads():
    before = torch.get_num_threads()
    try:
        assert thread_scaling(1) is None
        x = thread_scaling(2, n=128, reps=1)
        assert x is not None and 0 < x < 8  # a ratio of two timings (near 1 or 2 on two vCPUs), not a rate
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
