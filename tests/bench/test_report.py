"""Results folder, CLI and compare: every file is written, complete and consistent with the run."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from leverlab.bench import BenchConfig, run_benchmark
from leverlab.bench.compare import compare, load_summary, run_compare
from leverlab.bench.report import PLOT_FILES
from leverlab.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def small_run(fake_server, make_workload, tmp_path):
    wl = make_workload(
        {
            "short": (4, [f"[ttft=5 itl=5] s{i}" for i in range(3)]),
            "medium": (6, [f"[ttft=60 itl=5] m{i}" for i in range(3)]),
        }
    )
    out = tmp_path / "run-a"
    res = run_benchmark(
        BenchConfig(
            base_url=fake_server,
            workload_file=str(wl),
            concurrency=[1, 2],
            sweep_rounds=2,
            warmup=1,
            seed=7,
            slo_ttft_ms=30,
            out_dir=str(out),
        )
    )
    return res, out


def test_results_folder_complete(small_run):
    res, out = small_run
    for name in ("records.jsonl", "summary.json", "summary.csv", "report.md"):
        assert (out / name).stat().st_size > 0, name
    for name in PLOT_FILES:
        assert (out / "plots" / name).read_bytes()[:8] == PNG_MAGIC, name

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    # every request accounted for: warm-up + single (3 + 3) + sweep (max(3, 2*1) + max(3, 2*2))
    assert len(records) == 1 + 6 + 3 + 4
    assert sum(r["group"] == "warmup" for r in records) == 1
    assert all(r["ok"] and r["output_tokens"] == r["output_len"] for r in records)

    summary = json.loads((out / "summary.json").read_text())
    names = [g["name"] for g in summary["groups"]]
    assert names == ["single/short", "single/medium", "sweep/medium/c1", "sweep/medium/c2"]
    for g in summary["groups"]:
        assert g["requests"] == sum(r["group"] == g["name"] for r in records)
        assert g["total_output_tokens"] == sum(r["output_tokens"] for r in records if r["group"] == g["name"])
    short = summary["groups"][0]
    assert short["good_requests"] == 3  # TTFT 5 ms under the 30 ms SLO (25 ms of margin for a loaded machine)
    assert summary["groups"][1]["good_requests"] == 0  # TTFT 60 ms

    m = summary["manifest"]
    assert m["server"]["base_url"] == res.config.base_url and m["server"]["model"] == "fake-model"
    assert m["server"]["version"]["version"] == "0.0-fake"  # the lever settings the server reports
    assert m["seed"] == 7 and m["config"]["seed"] == 7
    assert "revision" in m["git"] and m["machine"]["cpu_count"]
    assert m["workload"]["kind"] == "buckets" and len(m["workload"]["sha256"]) == 64
    assert m["workload"]["buckets"]["short"]["output_len"] == [4]
    assert [p["requests"] for p in m["phases"]] == [3, 3, 3, 4]
    # the run's counter deltas start after warm-up; the sweep's concurrency-1 point reuses single/medium's 3
    # requests (the same requests, sent the same way) instead of sending them again
    assert [g["same_requests_as"] for g in summary["groups"]] == [None, None, "single/medium", None]
    assert summary["prometheus"]["deltas"]["fake_requests_total"] == len(records) - 1 - 3

    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == names
    assert float(rows[0]["e2e_s_p50"]) == pytest.approx(short["e2e_s"]["p50"])
    assert "ttft_ms_tm95" in rows[0] and "server_decode_ms_mean" in rows[0]

    md = (out / "report.md").read_text()
    for needle in (
        "Single-request latency",
        "Concurrency sweep",
        "sweep/medium/c2",
        "Where the time went",
        "plots/latency_vs_load.png",
        "docs/bench.md",
    ):
        assert needle in md, needle


def test_compare_ratios(small_run, tmp_path):
    _, a = small_run
    b = tmp_path / "run-b"
    shutil.copytree(a, b)
    s = json.loads((b / "summary.json").read_text())
    s["groups"][0]["e2e_s"]["p50"] *= 2
    s["groups"][0]["output_throughput"] /= 4
    s["groups"] = s["groups"][:-1]  # one group only in A
    (b / "summary.json").write_text(json.dumps(s))

    c = compare(load_summary(a), load_summary(b))
    g = {x["name"]: x["figures"] for x in c["groups"]}
    assert g["single/short"]["e2e_s_p50"]["ratio"] == pytest.approx(2.0)
    assert g["single/short"]["output_throughput"]["ratio"] == pytest.approx(0.25)
    assert g["single/medium"]["e2e_s_p50"]["ratio"] == pytest.approx(1.0)
    assert c["only_in_a"] == ["sweep/medium/c2"] and c["only_in_b"] == []

    out = tmp_path / "cmp"
    assert main(["bench", "compare", str(a), str(b), "--out", str(out)]) == 0
    md = (out / "compare-run-b.md").read_text()
    assert "| e2e_s_p50 |" in md and "2.000" in md
    assert json.loads((out / "compare-run-b.json").read_text())["only_in_a"] == ["sweep/medium/c2"]
    c2 = run_compare(str(a), str(a), out=str(tmp_path / "self"))
    assert all(f["ratio"] in (None, 1.0) for grp in c2["groups"] for f in grp["figures"].values())


def test_cli_run_and_errors(fake_server, make_workload, tmp_path, capsys):
    wl = make_workload({"medium": (3, ["[ttft=10 itl=2] a", "[ttft=10 itl=2] b"])})
    out = tmp_path / "cli"
    rc = main(
        [
            "bench",
            "--base-url",
            fake_server,
            "--workload-file",
            str(wl),
            "--concurrency",
            "1,2",
            "--warmup",
            "0",
            "--out",
            str(out),
            "--quiet",
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    assert (out / "summary.json").is_file() and len(list((out / "plots").glob("*.png"))) == 4
    printed = capsys.readouterr().out
    assert "sweep/medium/c2" in printed and "results:" in printed
    # a failing request makes the exit status 1 but still writes everything
    wl_bad = make_workload({"medium": (3, ["[fail=500] x"])})
    rc = main(
        [
            "bench",
            "--base-url",
            fake_server,
            "--workload-file",
            str(wl_bad),
            "--concurrency",
            "",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "bad"),
            "--quiet",
        ]
    )
    assert rc == 1 and (tmp_path / "bad" / "report.md").is_file()
    assert "## Errors" in (tmp_path / "bad" / "report.md").read_text()
    # usage errors exit 2
    assert main(["bench", "compare", "only-one"]) == 2
    assert (
        main(
            [
                "bench",
                "--base-url",
                fake_server,
                "--workload-file",
                str(tmp_path / "missing.json"),
                "--quiet",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "prompt set not found" in capsys.readouterr().err
    # no server: a clear message, exit 2
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--workload-file", str(wl), "--quiet"]) == 2
    assert "could not list models" in capsys.readouterr().err


def test_bench_import_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, leverlab.bench, leverlab.bench.cli, leverlab.bench.workloads;"
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_quick_preset_and_explicit_flags_win():
    import argparse

    from leverlab.bench import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    defaults = p.parse_args([])
    assert {k: getattr(defaults, k) for k in cli._DEFAULTS} == cli._DEFAULTS  # kept in step with the parser
    q = cli.config_from_args(p.parse_args(["--quick"]))
    assert (q.num_prompts, q.concurrency, q.sweep_rounds, q.warmup) == (2, [1, 2, 4], 1, 1)
    q = cli.config_from_args(p.parse_args(["--quick", "--concurrency", "1,8", "--num-prompts", "5"]))
    assert (q.num_prompts, q.concurrency, q.warmup) == (5, [1, 8], 1)
    assert cli.config_from_args(p.parse_args([])).concurrency == [1, 2, 4, 8, 16]
