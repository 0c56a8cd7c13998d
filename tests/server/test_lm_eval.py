"""lm-evaluation-harness against `leverlab serve` (scripts/lm_eval_check.py): a loglikelihood task and a
generation task through local-completions and local-chat-completions. Skipped where lm-eval's venv has not
been set up (the script sets it up; the test does not install anything)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lm_eval_check import venv_dir  # noqa: E402


@pytest.mark.slow
def test_lm_eval_runs_both_tasks(tmp_path):
    if not (venv_dir() / "bin" / "lm_eval").exists():
        pytest.skip(f"lm-eval is not set up in {venv_dir()}: python scripts/lm_eval_check.py does it")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lm_eval_check.py"), "--limit", "3",
                        "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert out.count("|leverlab_gen|") == 2 and out.count("|leverlab_ll |") == 1, out[-6000:]
    assert "lm-eval ran every task" in out
