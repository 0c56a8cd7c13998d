"""The runner's bookkeeping against a stand-in server (tests/bench/fake_server.py): every configuration ends
with a status (done / unavailable / failed, with the reason), failures never stop the study, resume reruns
only what failed, and the report still renders without predictions or fidelity."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from leverlab.study.engines.base import Engine
from leverlab.study.plan import Levers, Plan, PlanBuilder
from leverlab.study.report import write_report
from leverlab.study.runner import run_study

FAKE_SERVER = str(Path(__file__).resolve().parent.parent / "bench" / "fake_server.py")


class FakeEngine(Engine):
    """bfloat16 / ngram: the stand-in server; int8: refused at start (exit 2); int4: crashes (exit 1)
    unless the marker file exists."""

    name = "fake"
    health_path = "/v1/models"

    def __init__(self, marker: Path):
        self.marker = marker

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        if levers.quantization == "int8":
            return [
                sys.executable,
                "-c",
                "import sys; print('leverlab serve: int8 is not built'); sys.exit(2)",
            ]
        if levers.quantization == "int4" and not self.marker.exists():
            return [
                sys.executable,
                "-c",
                "import sys; print('Traceback: boom', file=sys.stderr); sys.exit(1)",
            ]
        return [sys.executable, FAKE_SERVER, str(port)]


def plan() -> Plan:
    b = PlanBuilder()
    b.step("int8", "precision", "int8")
    b.step("int4", "precision", "int4", parent="baseline")
    b.step("ngram", "speculation", {"method": "ngram", "num_speculative_tokens": 4}, parent="baseline")
    b.step("static", "batching", "static", parent="baseline", single_buckets=())
    return Plan(
        "fake", b.steps, num_prompts=2, concurrency=[1, 2], sweep_bucket="short", warmup=1, fidelity_prompts=1
    )


def workload(tmp_path: Path) -> Path:
    prompts = [{"id": f"s{i}", "text": f"[ttft=5 itl=1] hello {i}", "num_tokens": 4} for i in range(2)]
    dprompts = [{"id": f"d{i}", "text": f"[ttft=5 itl=1] bye {i}", "num_tokens": 4} for i in range(2)]
    p = tmp_path / "wl.json"
    p.write_text(
        json.dumps(
            {
                "buckets": {
                    "short": {"input_tokens": 4, "output_len": 4, "prompts": prompts},
                    "decode": {"input_tokens": 4, "output_len": 16, "prompts": dprompts},
                }
            }
        )
    )
    return p


def test_statuses_reasons_resume_and_report(tmp_path):
    marker = tmp_path / "fixed"
    out = tmp_path / "study"
    eng = FakeEngine(marker)
    state = run_study(plan(), eng, "fake-model", out, source_workload=workload(tmp_path), bandwidth_gbs=10.0)
    cfgs = state.data["configs"]
    assert cfgs["baseline"]["status"] == "done" and cfgs["ngram"]["status"] == "done"
    assert cfgs["int8"]["status"] == "unavailable" and cfgs["int8"]["reason"] == "int8 is not built"
    assert cfgs["int4"]["status"] == "failed" and "exited with 1" in cfgs["int4"]["reason"]
    assert "boom" in cfgs["int4"]["log_tail"]
    # the stand-in answers completions only as a stream: the fidelity pass fails, recorded, config still done
    assert "fidelity_error" in cfgs["baseline"]
    assert (out / "baseline" / "bench" / "summary.json").is_file()
    # single_buckets: the c=1 pass over those and the sweep bucket only (here none: the sweep bucket alone)
    groups = json.loads((out / "static" / "bench" / "summary.json").read_text())["groups"]
    assert [g["name"] for g in groups if g["kind"] == "single"] == ["single/short"]
    assert {g["concurrency"] for g in groups if g["kind"] == "sweep"} == {1, 2}
    base = json.loads((out / "baseline" / "bench" / "summary.json").read_text())["groups"]
    assert {g["name"] for g in base if g["kind"] == "single"} == {"single/decode", "single/short"}

    a = write_report(out)
    md = (out / "report.md").read_text()
    assert "not available on this engine: int8 is not built" in md
    assert "FAILED: server exited with 1" in md
    assert a["configs"][3]["metrics"]["sweep"][2]["request_throughput"] > 0
    assert "<img" in (out / "report.html").read_text()

    marker.write_text("")  # int4 now starts: resume runs it again, keeps the rest
    before = {k: v.get("started") for k, v in cfgs.items()}
    state = run_study(plan(), eng, "fake-model", out, source_workload=workload(tmp_path), resume=True)
    cfgs = state.data["configs"]
    assert cfgs["int4"]["status"] == "done"
    assert cfgs["baseline"]["started"] == before["baseline"] and cfgs["int8"]["status"] == "unavailable"
