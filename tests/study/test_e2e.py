"""End to end: a tiny plan (baseline + n-gram, one bucket, concurrency 1 and 2) on a tiny random checkpoint,
through real `leverlab serve` processes; then the report, opened in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from leverlab.study.engines.leverlab import LeverLabEngine
from leverlab.study.plan import Levers, Plan, PlanBuilder
from leverlab.study.report import write_report
from leverlab.study.runner import run_study

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n",
]

# ~25 s on the 2 shared cores when they are quiet (60 s and more under contention): two server starts, the
# harness, fidelity over HTTP and the n-gram step's float32 pair in-process, Chromium. Not marked slow: it is the study's one end-to-end test.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def tiny_plan() -> Plan:
    b = PlanBuilder(levers=Levers(dtype="float32"))
    b.step("ngram", "speculation", {"method": "ngram", "num_speculative_tokens": 3})
    return Plan(
        "tiny",
        b.steps,
        buckets=["short"],
        num_prompts=2,
        concurrency=[1, 2],
        sweep_bucket="short",
        sweep_rounds=1,
        warmup=1,
        fidelity_prompts=2,
        fidelity_tokens=12,
    )


def write_workload(path):
    # 32 tokens out, not fewer: the server hands a stream the latest cumulative output (one-slot mailbox), and a
    # random tiny model can finish a 12-token request before the event loop sends its first chunk; the client
    # then sees all tokens at once, TPOT is undefined and the baseline had no decode rate (seen in CI).
    prompts = [
        {"id": f"short-{i}", "source": "test", "text": t, "num_tokens": 16} for i, t in enumerate(TEXTS)
    ]
    chat = [{"id": f"chat-{i}", "source": "test", "messages": [{"role": "user", "content": t}]}
            for i, t in enumerate(TEXTS)]
    path.write_text(
        json.dumps({"buckets": {"short": {"input_tokens": 16, "output_len": 32, "prompts": prompts}}, "chat": chat})
    )
    return path


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    base = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    return subprocess.run(base + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def study(checkpoint_factory, tmp_path_factory):
    ckpt = checkpoint_factory("qwen3")
    tmp = tmp_path_factory.mktemp("study")
    out = tmp / "study"
    state = run_study(
        tiny_plan(),
        LeverLabEngine(execution_mode="eager"),
        ckpt,
        out,
        source_workload=write_workload(tmp / "workload.json"),
        bandwidth_gbs=10.0,
    )
    return out, state, write_report(out)


def test_every_configuration_measured_with_fidelity_and_prediction(study):
    out, state, a = study
    assert [c["name"] for c in a["configs"]] == ["baseline", "ngram"]
    for c in a["configs"]:
        assert c["status"] == "done", (
            c["name"],
            c.get("reason"),
            state.data["configs"][c["name"]].get("log_tail"),
        )
        m = c["metrics"]
        assert m["e2e_p50_s"] > 0 and m["decode_tok_s"] > 0
        assert set(m["sweep"]) == {1, 2} and m["rps_cmax"] > 0
        assert m["request_errors"] == 0
        p = c["prediction"]
        assert p["roofline_tok_s"] > 0 and p["calibrated_tok_s"] > 0 and p["measured_decode_tok_s"] > 0
    base, ngram = a["configs"]
    # the baseline against itself is identical by construction; n-gram in float32 must be exact too
    assert base["fidelity"]["agreement"]["share_identical"] == 1.0
    assert base["fidelity"]["kl"]["mean"] == pytest.approx(0.0, abs=1e-9)
    f = ngram["fidelity"]
    assert f["agreement"]["n"] == 2 and f["perplexity"] > 1
    assert f["exactness"]["exact"] is True and not ngram["bug"]
    assert ngram["metrics"]["drafted"] is not None  # the spec counters were read from /metrics
    assert ngram["prediction"]["tokens_per_pass"] >= 1.0
    assert {f["id"] for f in a["findings"]} >= {"1", "2", "3", "S"}
    assert "agent" not in base["metrics"]  # no structured step: nobody runs the agent workload


def test_a_structured_step_and_its_parent_run_the_agent_workload(checkpoint_factory, tmp_path):
    """Finding J's figures: jump-forward off (the step) against on (its parent), on tool calls and JSON schemas."""
    b = PlanBuilder(levers=Levers(dtype="float32"))
    b.step("no-jf", "structured", False, single_buckets=())
    plan = Plan("structured", b.steps, buckets=["short"], num_prompts=1, concurrency=[1, 2], sweep_bucket="short",
                warmup=0, fidelity_prompts=1, fidelity_tokens=4)
    out = tmp_path / "study"
    state = run_study(plan, LeverLabEngine(execution_mode="eager"), checkpoint_factory("qwen3"), out,
                      source_workload=write_workload(tmp_path / "workload.json"), bandwidth_gbs=10.0)
    a = write_report(out)
    for c in a["configs"]:
        assert c["status"] == "done", (c["name"], c.get("reason"))
        assert c["metrics"]["agent"]["e2e_p50_s"] > 0 and state.data["configs"][c["name"]]["agent_errors"] == 0
    assert "--no-structured-outputs-jump-forward" in state.data["configs"]["no-jf"]["server_command"]
    assert next(f for f in a["findings"] if f["id"] == "J")["status"] != "not tested"


def test_report_markdown_has_every_section(study):
    out, _, a = study
    md = (out / "report.md").read_text()
    for section in (
        "## Progression",
        "## Recommendation",
        "## Findings",
        "## Single-lever tables",
        "## Predicted against measured",
        "## Fidelity against the baseline",
        "## Plots",
    ):
        assert section in md
    prog = md.split("## Progression")[1].split("## Recommendation")[0]
    assert "| baseline |" in prog and "| ngram |" in prog
    assert "speculation: ngram K=3 (vs baseline)" in prog
    assert "exact (2/2)" in md
    for png in ("latency_vs_concurrency.png", "pareto.png", "predicted_vs_measured.png"):
        assert (out / "plots" / png).stat().st_size > 5000
        assert f"plots/{png}" in md
    assert json.loads((out / "analysis.json").read_text())["configs"][1]["name"] == "ngram"


def test_resume_skips_finished_configurations(study, checkpoint_factory, tmp_path):
    out, _, _ = study
    state = run_study(
        tiny_plan(),
        LeverLabEngine(execution_mode="eager"),
        checkpoint_factory("qwen3"),
        out,
        source_workload=out / "workload.json",
        resume=True,
    )
    assert len(state.data["resumed"]) == 1
    assert all(c["status"] == "done" for c in state.data["configs"].values())


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_renders_in_headless_chromium(study, tmp_path):
    out, _, _ = study
    html = out / "report.html"
    assert re.search(r'(src|href)="(https?:|//)', html.read_text()) is None  # self-contained: nothing fetched
    dom = chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", html.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert len(re.findall(r"<table", dom.stdout)) >= 6
    imgs = re.findall(r'<img[^>]+src="data:image/png;base64,([A-Za-z0-9+/=]{100,})"', dom.stdout)
    assert len(imgs) == 3
    assert "<td>ngram</td>" in dom.stdout
    shot = tmp_path / "report.png"
    r = chromium(
        f"--user-data-dir={tmp_path / 'profile2'}",
        f"--screenshot={shot}",
        "--window-size=1280,2400",
        html.as_uri(),
    )
    assert r.returncode == 0 and shot.stat().st_size > 20_000, r.stderr[-2000:]
    shutil.copy(shot, out / "screenshot.png")


def test_compare_puts_two_study_folders_side_by_side(study, tmp_path):
    """`leverlab study compare A B` on real folders (here the same one twice, its copy from another machine
    with a faster memory figure): every configuration in both, ratios B/A, and the bandwidth-ratio check."""
    out, _, _ = study
    faster = tmp_path / "faster"
    shutil.copytree(out, faster)
    st = json.loads((faster / "study.json").read_text())
    st["bandwidth_gbs"] *= 2
    st["host"] = {**st["host"], "hostname": "another-machine"}  # two machines: what keeps the memory check
    (faster / "study.json").write_text(json.dumps(st))
    r = subprocess.run(
        [sys.executable, "-m", "leverlab.cli", "study", "compare", str(out), str(faster), "--out", str(tmp_path / "c")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "c" / "report.md").read_text()
    assert "## Side by side" in md and "| baseline |" in md and "| ngram |" in md
    c = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert c["bandwidth_ratio"] == 2.0 and [r["decode_speedup"] for r in c["rows"]] == [1.0, 1.0]
    # same figures under twice the bandwidth: the speedups do not track it
    assert c["memory_finding"]["status"] == "not reproduced" and "NOT REPRODUCED" in md
    bad = subprocess.run(
        [sys.executable, "-m", "leverlab.cli", "study", "compare", str(out)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "two study folders" in bad.stderr
