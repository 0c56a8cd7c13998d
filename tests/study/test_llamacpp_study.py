"""The study against a real peer: `leverlab study --engine leverlab,llamacpp` on the bundled model, two
configurations (bf16, int8), through real `leverlab serve` and `llama-server` processes; the study makes the GGUF
files itself. Skipped, with the reason, where llama.cpp is not installed
(`python -m leverlab.bench.peer_llamacpp build`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leverlab.study.engines.llamacpp import LlamaCppEngine

MISSING = LlamaCppEngine().installed()

PLAN = """
name = "two"
num_prompts = 1
output_scale = 0.0625
concurrency = [1, 2]
buckets = ["short"]
sweep_bucket = "short"
warmup = 1
fidelity_prompts = 1
fidelity_tokens = 12
[baseline]
dtype = "bfloat16"
[[steps]]
name = "int8"
precision = "int8"
"""


@pytest.mark.slow
@pytest.mark.skipif(MISSING is not None, reason=f"llama.cpp: {MISSING}")
def test_two_configuration_llamacpp_study_side_by_side(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    out = tmp_path / "both"
    cmd = [sys.executable, "-m", "leverlab.cli", "study", "--engine", "leverlab,llamacpp", "--plan", str(plan)]
    cmd += ["--out", str(out), "--quiet", "--bandwidth", "10"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((out / "llamacpp" / "study.json").read_text())
    for name in ("baseline", "int8"):
        rec = state["configs"][name]
        assert rec["status"] == "done", (name, rec.get("reason"), rec.get("log_tail"))
        assert rec["requests_completed"] > 0 and rec["request_errors"] == 0
        assert "llama-server" in rec["server_command"][0]
    made = state["engine_files"]["gguf"]
    assert made["bfloat16"].endswith("model-bf16.gguf") and made["int8"].endswith("model-q8_0.gguf")
    a = json.loads((out / "llamacpp" / "analysis.json").read_text())
    assert a["configs"][1]["fidelity"]["agreement"]["n"] == 1  # int8 against llama.cpp's own bf16
    md = (out / "report.md").read_text()
    assert "leverlab, llamacpp side by side on one machine" in md and "one invocation" in md
    side = md.split("## Side by side")[1].split("\n## ")[0]
    assert "leverlab: decode tok/s c=1" in side and "llamacpp: decode tok/s c=1" in side
    rows = [ln for ln in side.splitlines() if ln.startswith("| baseline |") or ln.startswith("| int8 |")]
    assert len(rows) == 2 and all(ln.count("| ok |") == 2 for ln in rows), side
    # one machine: no bandwidth-ratio check; the engines compared lever by lever instead
    assert "bandwidth-ratio" not in md and "leverlab's int8 at c=1 is" in md
    assert (out / "compare.json").is_file() and (out / "report.html").is_file()
    assert (out / "plots" / "engines_pareto.png").is_file()
