"""Two study folders from two machines side by side (is faster memory the cleanest lever?), e.g. a CPU against a
GPU run. Folders from one machine (`leverlab study --engine a,b,...`, or the same host) get the engines'
side-by-side report instead (sidebyside.py), which has no bandwidth-ratio check: `leverlab study compare`
picks by sidebyside.same_machine().

Configurations are matched by name. Per configuration: both runs' figures and B over A. The memory check: the
bandwidth model says a memory-bound decode speeds up by the bandwidth ratio and nothing else; each
configuration's measured decode speedup is set against the two folders' measured bandwidth ratio, and the
finding is judged from how many track it within TRACK_TOLERANCE. When the two runs saw the same bandwidth
(two engines, one machine), the check cannot say anything and says so: the differences are the engines'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leverlab.study.analysis import analyze, to_jsonable
from leverlab.study.report.doc import Doc
from leverlab.study.report.fmt import _m, fmt, pct, ratio, rx, status_text

TRACK_TOLERANCE = 0.25  # the predictions' own tolerance (predict.py flags gaps over 25%)
SAME_MEMORY = 0.10  # bandwidth ratios within 10% of 1 are the same memory, given run-to-run drift


def _identical(c: dict[str, Any] | None) -> str:
    agr = ((c or {}).get("fidelity") or {}).get("agreement")
    return pct(agr.get("share_identical")) if agr else "–"


def compare(a_dir: Path, b_dir: Path, labels: tuple[str, str] | None = None) -> dict[str, Any]:
    """The numbers of the comparison (what compare.json holds)."""
    A, B = analyze(Path(a_dir)), analyze(Path(b_dir))
    la, lb = labels or (f"{A['engine']} ({Path(a_dir).name})", f"{B['engine']} ({Path(b_dir).name})")
    bw_ratio = ratio(B.get("bandwidth_gbs"), A.get("bandwidth_gbs"))
    by_a = {c["name"]: c for c in A["configs"]}
    by_b = {c["name"]: c for c in B["configs"]}
    names = list(by_a) + [n for n in by_b if n not in by_a]
    rows = []
    for n in names:
        ca, cb = by_a.get(n), by_b.get(n)
        ma, mb = _m(ca or {}), _m(cb or {})
        speedup = ratio(mb.get("decode_tok_s"), ma.get("decode_tok_s"))
        rows.append(
            {
                "name": n,
                "change": (ca or cb)["change"],
                "a": ca,
                "b": cb,
                "decode_speedup": speedup,
                "latency_speedup": ratio(ma.get("e2e_p50_s"), mb.get("e2e_p50_s")),
                "throughput_ratio": ratio(mb.get("rps_cmax"), ma.get("rps_cmax")),
                "speedup_over_bandwidth": ratio(speedup, bw_ratio),
            }
        )
    return {
        "labels": [la, lb],
        "folders": [str(a_dir), str(b_dir)],
        "bandwidth_gbs": [A.get("bandwidth_gbs"), B.get("bandwidth_gbs")],
        "bandwidth_ratio": bw_ratio,
        "rows": rows,
        "memory_finding": memory_finding(rows, bw_ratio),
        "analyses": [A, B],
    }


def memory_finding(rows: list[dict[str, Any]], bw_ratio: float | None) -> dict[str, str]:
    """'Faster memory is the cleanest lever': every configuration's decode speeds up by the bandwidth ratio."""
    title = "Faster memory is the cleanest lever"
    if bw_ratio is None:
        return {"title": title, "status": "not tested", "why": "a folder has no measured bandwidth"}
    if abs(bw_ratio - 1) < SAME_MEMORY:
        return {
            "title": title,
            "status": "not tested",
            "why": f"both runs read memory at about the same rate (B/A {bw_ratio:.2f}x): the differences below "
            "are the engines' or the machines' compute, not their memory; test it with two machines",
        }
    got = [r["speedup_over_bandwidth"] for r in rows if r["speedup_over_bandwidth"] is not None]
    if not got:
        return {"title": title, "status": "not tested", "why": "no configuration was measured in both runs"}
    tracks = sum(abs(x - 1) <= TRACK_TOLERANCE for x in got)
    status = "reproduced" if tracks == len(got) else "partly" if tracks * 3 >= len(got) * 2 else "not reproduced"
    return {
        "title": title,
        "status": status,
        "why": f"{tracks} of {len(got)} configurations' decode speedups are within {TRACK_TOLERANCE:.0%} of the "
        f"bandwidth ratio {bw_ratio:.2f}x (speedup / bandwidth ratio from {min(got):.2f} to {max(got):.2f})",
    }


def build(c: dict[str, Any]) -> Doc:
    la, lb = c["labels"]
    d = Doc()
    d.h(1, f"LeverLab study comparison: {la} against {lb}")
    bw = c["bandwidth_gbs"]
    d.p(
        f"A = **{la}** (`{c['folders'][0]}`), B = **{lb}** (`{c['folders'][1]}`). Measured memory read "
        f"bandwidth {fmt(bw[0], '.1f')} and {fmt(bw[1], '.1f')} GB/s (B/A {rx(c['bandwidth_ratio'])}). "
        "Configurations are matched by name; ratios are B over A (latency: A over B, so above 1 is B faster)."
    )
    _side_by_side(d, c)
    _memory(d, c)
    return d


def _side_by_side(d: Doc, c: dict[str, Any]) -> None:
    d.h(2, "Side by side")
    rows = []
    for r in c["rows"]:
        ma, mb = _m(r["a"] or {}), _m(r["b"] or {})
        rows.append(
            [
                r["name"],
                r["change"],
                fmt(ma.get("decode_tok_s"), ".1f"),
                fmt(mb.get("decode_tok_s"), ".1f"),
                rx(r["decode_speedup"]),
                fmt(ma.get("e2e_p50_s")),
                fmt(mb.get("e2e_p50_s")),
                rx(r["latency_speedup"]),
                fmt(ma.get("rps_cmax"), ".3f"),
                fmt(mb.get("rps_cmax"), ".3f"),
                rx(r["throughput_ratio"]),
                _identical(r["a"]),
                _identical(r["b"]),
                status_text(r["a"]) if r["a"] else "not in A's plan",
                status_text(r["b"]) if r["b"] else "not in B's plan",
            ]
        )
    d.table(
        [
            "config",
            "change",
            "A decode tok/s",
            "B decode tok/s",
            "B/A",
            "A P50 s",
            "B P50 s",
            "latency A/B",
            "A req/s (top c)",
            "B req/s (top c)",
            "B/A",
            "A greedy identical",
            "B greedy identical",
            "A status",
            "B status",
        ],
        rows,
        cls="progression",
    )
    d.p("Greedy identical: against each run's own baseline (each engine's baseline is its own reference).")


def _memory(d: Doc, c: dict[str, Any]) -> None:
    f = c["memory_finding"]
    d.h(2, "The bandwidth-ratio check (faster memory)")
    d.p(f"**{f['title']}**: {f['status'].upper()}. {f['why']}.")
    d.table(
        ["config", "bandwidth B/A", "decode speedup B/A", "speedup / bandwidth ratio"],
        [
            [r["name"], rx(c["bandwidth_ratio"]), rx(r["decode_speedup"]), fmt(r["speedup_over_bandwidth"], ".2f")]
            for r in c["rows"]
        ],
    )


def write_compare(a_dir: Path, b_dir: Path, out_dir: Path, labels: tuple[str, str] | None = None) -> dict:
    c = compare(a_dir, b_dir, labels)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = build(c)
    (out_dir / "report.md").write_text(doc.markdown(out_dir))
    (out_dir / "report.html").write_text(doc.html(f"LeverLab study comparison: {' vs '.join(c['labels'])}"))
    slim = {k: v for k, v in c.items() if k != "analyses"}
    slim["rows"] = [{k: v for k, v in r.items() if k not in ("a", "b")} for r in c["rows"]]
    (out_dir / "compare.json").write_text(json.dumps(to_jsonable(slim), indent=1, default=str))
    return c
