"""Engines side by side on one machine (leverlab/study/sidebyside.py): one report for any number of engines,
lever-by-lever findings, substitutions labelled, no bandwidth-ratio check, every engine on one chart; and the
runner's nearest-parent substitution through real (stand-in) servers. Study folders are written here with known
figures (no servers) so the report's numbers are exact, except in the runner test."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from leverlab.study import cli
from leverlab.study.engines.base import Engine
from leverlab.study.plan import Levers, Plan, PlanBuilder
from leverlab.study.runner import run_study
from leverlab.study.sidebyside import same_machine, write_side_by_side
from leverlab.study.substitute import resolve_plan
from tests.study.test_e2e import CHROMIUM, chromium
from tests.study.test_runner import FAKE_SERVER, workload

HOST = {"hostname": "box", "cpu_count": 2}
EAGLE = {"method": "eagle", "model": "models/leverlab-code-eagle", "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def plan() -> Plan:
    b = PlanBuilder()
    b.step("int8", "precision", "int8")
    b.step("int8-ngram", "speculation", NGRAM)
    b.step("int8-eagle", "speculation", EAGLE, parent="int8")
    b.step("champion", "precision", "int4")
    b.step("champion-tp2", "tensor_parallel", 2)
    return Plan("mini", b.steps, num_prompts=2, concurrency=[1, 4], sweep_bucket="short", warmup=1, fidelity_prompts=1)


def no_eagle(levers: Levers) -> dict[str, str]:
    gaps = {}
    if (levers.speculative or {}).get("method") == "eagle":
        gaps["speculation"] = "no EAGLE here"
    if levers.tensor_parallel_size != 1:
        gaps["tensor_parallel"] = "no tensor parallelism"
    return gaps


def summary(decode: float, out_c4: float) -> dict:
    """A harness summary.json with the figures the report reads: the short bucket at c=1, the sweep at 1 and 4."""

    def group(kind, c, dec, out_tput):
        e2e = 64 / dec
        return {
            "name": f"{kind}/short/c{c}",
            "kind": kind,
            "bucket": "short",
            "concurrency": c,
            "e2e_s": {"p50": e2e * (1 + (c - 1) / 4), "tm95": e2e, "p99": e2e},
            "ttft_ms": {"p50": 20.0 * c},
            "decode_tok_s": {"p50": dec},
            "input_tokens": {"mean": 64},
            "output_tokens": {"mean": 64},
            "request_throughput": out_tput / 64,
            "output_throughput": out_tput,
            "errors": 0,
            "completed": 4,
        }

    return {
        "groups": [
            group("single", 1, decode, decode),
            group("sweep", 1, decode, decode),
            group("sweep", 4, decode, out_c4),
        ]
    }


def write_study(root: Path, engine: str, figures: dict[str, tuple], gaps=lambda lv: {}, run_id="r1", host=HOST):
    """A finished study folder: figures[name] = (decode tok/s, output tok/s at c=4, greedy output tokens), or a
    refusal reason string; substitutions as the runner records them."""
    p = plan()
    resolved = resolve_plan(p, gaps)
    configs = {}
    for s in p.steps:
        f = figures[s.name]
        d = root / s.name
        if isinstance(f, str):
            configs[s.name] = {"status": "unavailable", "reason": f}
            continue
        (d / "bench").mkdir(parents=True)
        (d / "bench" / "summary.json").write_text(json.dumps(summary(f[0], f[1])))
        (d / "fidelity-samples.json").write_text(json.dumps({"samples": [{"id": "a", "output": f[2]}]}))
        rec = {"status": "done", "levers": asdict(resolved[s.name].levers)}
        sub = resolved[s.name].record(s, engine)
        if sub:
            rec["substitution"] = sub
        configs[s.name] = rec
    state = {
        "plan": p.to_json(),
        "model": str(root / "no-model"),
        "engine": engine,
        "bandwidth_gbs": 16.0,
        "host": host,
        "run_id": run_id,
        "configs": configs,
        "elapsed_s": 120.0,
        "setup_s": 5.0,
    }
    (root / "study.json").write_text(json.dumps(state))
    return root


def three_engines(root: Path) -> dict[str, Path]:
    """alpha measures every configuration; beta has no EAGLE and no TP (its champion substituted); gamma is
    flat. Decode tok/s chosen so the ratios are exact."""
    same = ["1", "2"]
    alpha = write_study(
        root / "alpha",
        "alpha",
        {
            "baseline": (100.0, 400.0, same),
            "int8": (220.0, 600.0, same),
            "int8-ngram": (300.0, 500.0, same),
            "int8-eagle": (400.0, 700.0, same),
            "champion": (500.0, 800.0, ["1", "9"]),
            "champion-tp2": (550.0, 700.0, ["1", "9"]),
        },
    )
    beta = write_study(
        root / "beta",
        "beta",
        {
            "baseline": (50.0, 300.0, same),
            "int8": (55.0, 300.0, same),
            "int8-ngram": (100.0, 280.0, same),
            "int8-eagle": "speculation: no EAGLE here",
            "champion": (125.0, 300.0, same),
            "champion-tp2": "tensor_parallel: no tensor parallelism",
        },
        gaps=no_eagle,
    )
    gamma = write_study(
        root / "gamma",
        "gamma",
        {n: (80.0, 320.0, same) for n in ("baseline", "int8", "int8-ngram", "int8-eagle", "champion", "champion-tp2")},
    )
    return {"alpha": alpha, "beta": beta, "gamma": gamma}


@pytest.fixture()
def three(tmp_path):
    return three_engines(tmp_path)


def test_one_report_for_three_engines_with_lever_by_lever_findings(three, tmp_path):
    out = tmp_path / "out"
    c = write_side_by_side(three, out)
    assert c["engines"] == ["alpha", "beta", "gamma"] and c["one_machine"] == "one invocation (run r1)"
    md = (out / "report.md").read_text()
    assert md.count("## Side by side") == 1
    side = md.split("## Side by side")[1].split("\n## ")[0]
    head = side.strip().splitlines()[0]
    for e in ("alpha", "beta", "gamma"):
        for col in ("decode tok/s c=1", "output tok/s c=4", "TTFT ms", "greedy identical", "status"):
            assert f"{e}: {col}" in head
    base = next(ln for ln in side.splitlines() if ln.startswith("| baseline |"))
    assert "| 100.0 | 400.0 | 20 | 100% | ok |" in base and "| 50.0 | 300.0 |" in base
    # a refusal is the engine's reason (a footnote), a substitution says what stood in and from where
    champ = next(ln for ln in side.splitlines() if ln.startswith("| champion |"))
    assert "| 500.0 | 800.0 | 20 | 0% | ok |" in champ and "ok, substituted [" in champ
    assert "not available [" in next(ln for ln in side.splitlines() if ln.startswith("| int8-eagle |"))
    assert "beta: speculation: no EAGLE here" in side
    assert "champion on beta runs as int4 + ngram K=4 in place of eagle K=3 (from int8-ngram: no EAGLE here); " \
           "compared with int8-ngram" in side
    # findings, lever by lever: each engine against its own parent, and the first engine over the others
    f = {x["config"]: x for x in c["lever_findings"]}
    assert f["int8"]["engines"]["alpha"]["decode_x"] == pytest.approx(2.2)
    assert f["int8"]["engines"]["beta"]["decode_x"] == pytest.approx(1.1)
    assert f["int8"]["first_over"] == pytest.approx({"beta": 4.0, "gamma": 2.75})
    assert ("decode at c=1: alpha 2.20x its baseline, beta 1.10x its baseline, gamma 1.00x its baseline" in
            f["int8"]["text"])
    assert "the lever helps alpha and beta at c=1, not gamma" in f["int8"]["text"]
    assert "alpha's int8 at c=1 is 4.00x beta's and 2.75x gamma's" in f["int8"]["text"]
    # beta's champion is set against its effective parent (int8-ngram), not the refused int8-eagle
    bc = f["champion"]["engines"]["beta"]
    assert bc["parent"] == "int8-ngram" and bc["decode_x"] == pytest.approx(1.25) and "ngram K=4" in bc["substituted"]
    assert "beta 1.25x its int8-ngram (substituted)" in f["champion"]["text"]
    assert "not measured on beta: speculation: no EAGLE here" in f["int8-eagle"]["text"]
    assert "## Findings: the engines compared lever by lever" in md and "decode c=1: alpha / beta" in md
    # one machine: no bandwidth-ratio check, no faster-memory finding
    assert "bandwidth-ratio check" not in md and "Faster memory is the cleanest lever" not in md
    assert all(x["id"] != "5" for fs in c["reference_findings"].values() for x in fs)
    assert "| 2 | Precision speedups track the byte ratio |" in md
    # every engine on one chart, embedded
    assert (out / "plots" / "engines_pareto.png").stat().st_size > 5000
    html = (out / "report.html").read_text()
    assert len(re.findall(r'<img[^>]+src="data:image/png;base64,', html)) == 2
    assert '<th colspan="5" class="group">beta</th>' in html
    assert json.loads((out / "compare.json").read_text())["engines"] == ["alpha", "beta", "gamma"]


def test_same_machine_from_study_json():
    assert same_machine([{"run_id": "x"}, {"run_id": "x"}]) == "one invocation (run x)"
    assert same_machine([{"run_id": "x", "host": HOST}, {"run_id": "y", "host": HOST}]) == "one host (box, 2 cores)"
    assert same_machine([{"host": HOST}, {"host": {"hostname": "other", "cpu_count": 2}}]) is None
    assert same_machine([{}, {}]) is None  # folders from before host and run id were recorded: cannot tell


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_compare_one_machine_side_by_side_two_machines_bandwidth_check(three, tmp_path):
    from rich.console import Console

    console = Console(stderr=True)
    out = tmp_path / "c1"
    rc = cli.run(_args(model="compare", folders=[str(three["alpha"]), str(three["beta"])], out=str(out)))
    assert rc == 0
    md = (out / "report.md").read_text()
    assert "alpha, beta side by side on one machine" in md and "bandwidth-ratio" not in md
    # another machine (another host, another run): the two-machine comparison keeps its memory check
    st = json.loads((three["gamma"] / "study.json").read_text())
    st.update(run_id=None, host={"hostname": "faster-box", "cpu_count": 8}, bandwidth_gbs=32.0)
    (three["gamma"] / "study.json").write_text(json.dumps(st))
    out2 = tmp_path / "c2"
    assert cli.run(_args(model="compare", folders=[str(three["alpha"]), str(three["gamma"])], out=str(out2))) == 0
    md2 = (out2 / "report.md").read_text()
    assert "## The bandwidth-ratio check (faster memory)" in md2
    assert cli.run(_args(model="compare", folders=[str(three["alpha"]), str(three["beta"]), str(three["gamma"])],
                         out=str(tmp_path / "c3"))) == 2
    # --report-only on a several-engine folder rebuilds each engine's report and the side-by-side one
    both = tmp_path / "both"
    for e in ("alpha", "beta"):
        shutil.copytree(three[e], both / e)
    assert cli._report(both, console) == 0
    assert (both / "alpha" / "report.md").is_file() and "alpha, beta side by side" in (both / "report.md").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_side_by_side_html_renders_in_headless_chromium(three, tmp_path):
    out = tmp_path / "out"
    write_side_by_side(three, out)
    dom = chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", (out / "report.html").as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert len(re.findall(r'<img[^>]+src="data:image/png;base64,([A-Za-z0-9+/=]{100,})"', dom.stdout)) == 2
    assert "<td>champion</td>" in dom.stdout and 'class="group">gamma</th>' in dom.stdout


class NoEagleEngine(Engine):
    """The stand-in server for everything it takes; no EAGLE and no TP, said up front (as llama.cpp does)."""

    name = "noeagle"
    health_path = "/v1/models"

    def unsupported(self, levers: Levers) -> dict[str, str]:
        return no_eagle(levers)

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        return [sys.executable, FAKE_SERVER, str(port)]


def test_the_runner_measures_the_champion_from_the_nearest_parent(tmp_path):
    out = tmp_path / "study"
    light = plan()
    light.buckets, light.concurrency = ["short"], [1, 2]  # what is tested is which levers ran, not the figures
    state = run_study(light, NoEagleEngine(), "m", out, source_workload=workload(tmp_path), bandwidth_gbs=10.0,
                      run_id="r")
    cfgs = state.data["configs"]
    assert state.data["run_id"] == "r" and state.data["host"]["hostname"]
    assert cfgs["int8-eagle"]["status"] == "unavailable" and "no EAGLE here" in cfgs["int8-eagle"]["reason"]
    champ = cfgs["champion"]
    assert champ["status"] == "done", champ.get("reason")
    assert champ["levers"]["speculative"] == NGRAM and champ["levers"]["quantization"] == "int4"
    assert champ["substitution"]["parent"] == "int8-ngram" and champ["substitution"]["plan_parent"] == "int8-eagle"
    # its own lever (TP) is what the engine lacks: not available, the engine's reason, no substitution kept
    tp2 = cfgs["champion-tp2"]
    assert tp2["status"] == "unavailable" and tp2["reason"] == "tensor_parallel: no tensor parallelism"
    assert "substitution" not in tp2
    from leverlab.study.analysis import analyze

    a = analyze(out)
    c = next(x for x in a["configs"] if x["name"] == "champion")
    assert c["parent"] == "int8-ngram" and c["levers"].speculative == NGRAM
    assert c["change"].startswith("precision: int4; runs as int4 + ngram K=4 in place of eagle K=3")
    from leverlab.study.report import write_report

    write_report(out)
    md = (out / "report.md").read_text()
    assert "## Configurations run from the nearest parent" in md
    assert "**champion** runs as int4 + ngram K=4 in place of eagle K=3" in md



def test_several_engines_on_the_command_line_give_one_report_in_out(tmp_path, monkeypatch):
    """`leverlab study --engine alpha,beta,gamma`: one study per engine under OUT/<engine> with one run id, then
    ONE side-by-side report in OUT (no pairwise folders). The studies are stand-ins writing known figures."""
    runs = []
    figures = {"baseline": (100.0, 400.0, ["1"]), "int8": (150.0, 450.0, ["1"]), "int8-ngram": (200.0, 400.0, ["1"]),
               "int8-eagle": (250.0, 500.0, ["1"]), "champion": (300.0, 600.0, ["1"]),
               "champion-tp2": (320.0, 650.0, ["1"])}

    def fake_study(args, plan_, engine, console, run_id=None):
        runs.append((engine.name, run_id, args.out))
        write_study(Path(args.out), engine.name, figures, run_id=run_id)
        return 0

    monkeypatch.setattr(cli, "_study", fake_study)
    monkeypatch.setattr(cli, "_engine", lambda name, args: argparse.Namespace(name=name))
    out = tmp_path / "out"
    assert cli.run(_args(engine="alpha,beta,gamma", out=str(out))) == 0
    assert [r[0] for r in runs] == ["alpha", "beta", "gamma"] and len({r[1] for r in runs}) == 1 and runs[0][1]
    assert [Path(r[2]) for r in runs] == [out / "alpha", out / "beta", out / "gamma"]
    md = (out / "report.md").read_text()
    assert "alpha, beta, gamma side by side on one machine" in md and "one invocation" in md
    assert not list(out.glob("*-vs-*"))
