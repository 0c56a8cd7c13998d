"""Engines side by side on one machine: one report for `leverlab study --engine a,b,c` (and for `leverlab study
compare` of folders from one machine), however many engines.

    OUT/report.md, OUT/report.html   every configuration with a column group per engine (decode tok/s at c=1,
                                     output tok/s at the top concurrency, TTFT, fidelity against that
                                     engine's own baseline, status: the engine's reason where not available,
                                     or its stand-in where the configuration ran through a substitution),
                                     findings that compare the engines lever by lever, each engine's reading
                                     of the reference findings, and every engine on one latency-throughput chart
    OUT/compare.json                 the numbers; OUT/plots/engines_*.png

One machine means one memory system, so the bandwidth-ratio check of a two-machine comparison (compare.py,
finding 5, "faster memory") has nothing to measure and is left out; same_machine() decides from study.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leverlab.study.analysis import analyze, to_jsonable
from leverlab.study.findings import MARGIN
from leverlab.study.report.doc import Doc
from leverlab.study.report.fmt import _m, fmt, pct, ratio, rx

# The reference finding that needs two machines (findings.check_memory); the one-machine report drops it.
TWO_MACHINE_FINDINGS = ("5",)


def same_machine(states: list[dict[str, Any]]) -> str | None:
    """Why these studies ran on one machine, or None when they did not (or cannot tell: folders from before
    host and run_id were recorded). One `--engine a,b` invocation shares a run_id; otherwise the same hostname
    and core count is the same machine (two runs on it read the same memory)."""
    ids = {s.get("run_id") for s in states}
    if len(ids) == 1 and None not in ids:
        return f"one invocation (run {ids.pop()})"
    hosts = {((s.get("host") or {}).get("hostname"), (s.get("host") or {}).get("cpu_count")) for s in states}
    if len(hosts) == 1 and (None, None) not in hosts and next(iter(hosts))[0]:
        h, n = hosts.pop()
        return f"one host ({h}, {n} cores)"
    return None


def _cell(c: dict[str, Any] | None) -> dict[str, Any]:
    """One engine's figures for one configuration."""
    if c is None:
        return {"status": "not in plan"}
    m = _m(c)
    agr = ((c.get("fidelity") or {}).get("agreement")) or {}
    return {
        "status": c["status"],
        "reason": c.get("reason"),
        "bug": c.get("bug"),
        "decode_tok_s": m.get("decode_tok_s"),
        "out_tok_s_cmax": m.get("out_tok_s_cmax"),
        "ttft_p50_ms": m.get("ttft_p50_ms"),
        "identical": agr.get("share_identical"),
        "parent": c.get("parent"),
        "substitution": c.get("substitution"),
        "change": c["change"],
    }


def side_by_side(dirs: dict[str, Path]) -> dict[str, Any]:
    """The numbers of the report (what compare.json holds, less the analyses). dirs: engine label -> folder."""
    analyses = {e: analyze(Path(d)) for e, d in dirs.items()}
    states = [json.loads((Path(d) / "study.json").read_text()) for d in dirs.values()]
    engines = list(analyses)
    names: list[str] = []
    for a in analyses.values():
        names += [c["name"] for c in a["configs"] if c["name"] not in names]
    by = {e: {c["name"]: c for c in a["configs"]} for e, a in analyses.items()}
    plan_change = {}
    for a in analyses.values():
        for s in a["plan"]["steps"]:
            plan_change.setdefault(s["name"], (s["change"], s["parent"]))
    rows = [
        {
            "name": n,
            "change": plan_change.get(n, ("?", None))[0],
            "parent": plan_change.get(n, ("?", None))[1],
            "engines": {e: _cell(by[e].get(n)) for e in engines},
        }
        for n in names
    ]
    first = next(iter(analyses.values()))
    return {
        "engines": engines,
        "folders": {e: str(d) for e, d in dirs.items()},
        "one_machine": same_machine(states),
        "model": first["model"],
        "plan": first["plan"],
        "cmax": max(first["plan"].get("concurrency") or [1]),
        "bandwidth_gbs": {e: a.get("bandwidth_gbs") for e, a in analyses.items()},
        "elapsed_s": {e: a.get("elapsed_s") for e, a in analyses.items()},
        "setup_s": {e: a.get("setup_s") for e, a in analyses.items()},
        "rows": rows,
        "lever_findings": lever_findings(rows, engines),
        "reference_findings": {
            e: [f for f in a["findings"] if f["id"] not in TWO_MACHINE_FINDINGS] for e, a in analyses.items()
        },
        "analyses": analyses,
    }


def _verdict(x: float | None) -> str:
    if x is None:
        return "n/a"
    return "faster" if x > 1 + MARGIN else "slower" if x < 1 - MARGIN else "flat"


def lever_findings(rows: list[dict[str, Any]], engines: list[str]) -> list[dict[str, Any]]:
    """Per configuration that changes a lever: what it does on each engine against that engine's own parent
    (decode at c=1, output at the top concurrency), and how the engines' absolute c=1 decode rates compare
    (the first engine against each other one)."""
    byn = {r["name"]: r for r in rows}
    out = []
    for r in rows:
        if r["parent"] is None:
            continue
        per: dict[str, dict[str, Any]] = {}
        for e in engines:
            c = r["engines"][e]
            if c["status"] != "done":
                per[e] = {"status": c["status"], "why": c.get("reason") or c["status"]}
                continue
            parent = c.get("parent") or r["parent"]
            p = (byn.get(parent) or {}).get("engines", {}).get(e) or {}
            if p.get("status") != "done":
                per[e] = {"status": "parent not measured", "why": f"its parent {parent} was not measured"}
                continue
            dec = ratio(c["decode_tok_s"], p.get("decode_tok_s"))
            per[e] = {
                "status": "done",
                "parent": parent,
                "decode_x": dec,
                "out_x": ratio(c["out_tok_s_cmax"], p.get("out_tok_s_cmax")),
                "verdict": _verdict(dec),
                "substituted": (c.get("substitution") or {}).get("label"),
            }
        ref = engines[0]
        across = {
            e: ratio(r["engines"][ref]["decode_tok_s"], r["engines"][e]["decode_tok_s"]) for e in engines[1:]
        }
        out.append(
            {"config": r["name"], "change": r["change"], "engines": per, "first_over": across, "text": _text(r, per, across, engines)}
        )
    return out


def _text(r: dict[str, Any], per: dict[str, dict[str, Any]], across: dict[str, float | None], engines) -> str:
    """'int8 (precision: int8): at c=1 leverlab 1.80x its baseline, vllm 1.10x its baseline; ...'."""
    measured = [e for e in engines if per[e]["status"] == "done"]
    parts = []
    if measured:
        dec = ", ".join(
            f"{e} {rx(per[e]['decode_x'])} its {per[e]['parent']}" + (" (substituted)" if per[e]["substituted"] else "")
            for e in measured
        )
        parts.append(f"decode at c=1: {dec}")
        outs = [f"{e} {rx(per[e]['out_x'])}" for e in measured if per[e]["out_x"] is not None]
        if outs:
            parts.append("output tok/s under load: " + ", ".join(outs))
        helps = [e for e in measured if per[e]["verdict"] == "faster"]
        if len(measured) > 1:
            if len(helps) == len(measured):
                best = max(measured, key=lambda e: per[e]["decode_x"] or 0)
                parts.append(f"the lever helps every engine at c=1, {best} most")
            elif helps:
                parts.append(f"the lever helps {' and '.join(helps)} at c=1, not {' or '.join(e for e in measured if e not in helps)}")
            else:
                parts.append("the lever helps no engine at c=1")
    ref = engines[0]
    cross = [f"{rx(x)} {e}'s" for e, x in across.items() if x is not None]
    if cross:
        parts.append(f"{ref}'s {r['name']} at c=1 is " + " and ".join(cross))
    missing = [f"{e}: {per[e]['why']}" for e in engines if per[e]["status"] != "done"]
    if missing:
        parts.append("not measured on " + "; ".join(missing))
    return f"**{r['name']}** ({r['change']}): " + "; ".join(parts) + "."


# ---- the document ---------------------------------------------------------------------------------------------


class _Notes:
    """Footnotes for reasons too long for a table cell: the same text gets the same number."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"


def _status(e: str, name: str, c: dict[str, Any], notes: _Notes) -> str:
    s = c["status"]
    if s == "done":
        if c.get("bug"):
            return "BUG: speculation changed greedy tokens"
        sub = c.get("substitution")
        if sub:
            return "ok, substituted " + notes.ref(
                f"{name} on {e} runs as {sub['label']}; compared with {sub['parent']}"
            )
        return "ok"
    if s == "unavailable":
        return "not available " + notes.ref(f"{e}: {c.get('reason')}")
    if s == "failed":
        return "FAILED " + notes.ref(f"{name} on {e}: {c.get('reason')}")
    return s


def build(c: dict[str, Any], plots: dict[str, Path]) -> Doc:
    engines, cmax = c["engines"], c["cmax"]
    d = Doc()
    d.h(1, f"LeverLab study: {', '.join(engines)} side by side on one machine")
    bw = [x for x in c["bandwidth_gbs"].values() if x]
    plan = c["plan"]
    times = "; ".join(
        f"{e} {fmt((c['elapsed_s'][e] or 0) / 60, '.1f')} min"
        + (f" (one-time setup {fmt(c['setup_s'][e], '.0f')} s apart)" if c["setup_s"].get(e) else "")
        for e in engines
    )
    d.p(
        f"Model `{c['model']}`, plan **{plan['name']}** ({len(c['rows'])} configurations, each changing one lever "
        f"from its parent), the same prompts on every engine; {c['one_machine'] or 'one machine'}. Measured memory "
        f"read bandwidth {fmt(bw[0] if bw else None, '.1f')} GB/s. Study time: {times}. Each engine's own report: "
        + ", ".join(f"`{e}/report.md`" for e in engines)
        + "."
    )
    d.p(
        "Fidelity (greedy identical) is against each engine's own baseline. Where an engine cannot express a value "
        "a configuration inherits, it runs the configuration from the nearest parent it can (a sibling step's "
        "value of that lever, first in plan order) and says so: *substituted*. The two-machine check (faster "
        "memory, the bandwidth ratio) has nothing to measure on one machine and is left out: "
        "`leverlab study compare A B` of two machines' folders runs it."
    )
    _table(d, c, engines, cmax)
    _levers(d, c, engines, cmax)
    _reference(d, c, engines)
    d.h(2, "Plots")
    d.img("Latency against throughput: every engine on one chart", plots["pareto"])
    d.img("Decode tok/s at concurrency 1, per configuration and engine", plots["decode"])
    return d


def _table(d: Doc, c: dict[str, Any], engines: list[str], cmax: int) -> None:
    d.h(2, "Side by side")
    notes = _Notes()
    cols = ["decode tok/s c=1", f"output tok/s c={cmax}", "TTFT ms", "greedy identical", "status"]
    rows = []
    for r in c["rows"]:
        row = [r["name"], r["change"] + (f" (vs {r['parent']})" if r["parent"] else "")]
        for e in engines:
            x = r["engines"][e]
            row += [
                fmt(x.get("decode_tok_s"), ".1f"),
                fmt(x.get("out_tok_s_cmax"), ".1f"),
                fmt(x.get("ttft_p50_ms"), ".0f"),
                pct(x.get("identical")) if x.get("identical") is not None else "–",
                _status(e, r["name"], x, notes),
            ]
        rows.append(row)
    d.table(
        ["config", "change"] + [f"{e}: {col}" for e in engines for col in cols],
        rows,
        cls="sidebyside",
        groups=[("", 2)] + [(e, len(cols)) for e in engines],
    )
    if notes.items:
        d.ul([f"[{i}] {t}" for i, t in enumerate(notes.items, 1)])


def _levers(d: Doc, c: dict[str, Any], engines: list[str], cmax: int) -> None:
    d.h(2, "Findings: the engines compared lever by lever")
    d.p(
        f"Each configuration against its parent on the same engine: decode tok/s at concurrency 1 and output "
        f"tok/s at concurrency {cmax}, as a ratio over the parent; then {engines[0]}'s absolute decode rate at "
        "concurrency 1 over each other engine's, for the same configuration."
    )
    d.ul([f["text"] for f in c["lever_findings"]])
    cols = ["decode x parent (c=1)", f"output x parent (c={cmax})"]
    rows = []
    for f in c["lever_findings"]:
        row = [f["config"], f["change"]]
        for e in engines:
            x = f["engines"][e]
            row += [rx(x.get("decode_x")), rx(x.get("out_x"))] if x["status"] == "done" else ["n/a", "n/a"]
        row += [rx(f["first_over"].get(e)) for e in engines[1:]]
        rows.append(row)
    d.table(
        ["config", "change"]
        + [f"{e}: {col}" for e in engines for col in cols]
        + [f"decode c=1: {engines[0]} / {e}" for e in engines[1:]],
        rows,
        cls="sidebyside",
        groups=[("", 2)]
        + [(e, len(cols)) for e in engines]
        + ([("decode c=1", len(engines) - 1)] if len(engines) > 1 else []),
    )


def _reference(d: Doc, c: dict[str, Any], engines: list[str]) -> None:
    d.h(2, "The reference study's findings, per engine")
    ref = c["reference_findings"]
    ids = []
    for e in engines:
        ids += [(f["id"], f["title"]) for f in ref[e] if (f["id"], f["title"]) not in ids]
    rows = []
    for fid, title in ids:
        row = [fid, title]
        for e in engines:
            f = next((x for x in ref[e] if x["id"] == fid and x["title"] == title), None)
            row.append(f["status"].upper() if f else "–")
        rows.append(row)
    d.table(["#", "finding"] + engines, rows)
    d.p("The evidence and reasons for each engine's results are in its own report.")


def write_side_by_side(dirs: dict[str, Path], out_dir: Path) -> dict[str, Any]:
    from leverlab.study.report.plots import write_engine_plots

    c = side_by_side(dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_engine_plots(c["analyses"], out_dir / "plots")
    doc = build(c, plots)
    (out_dir / "report.md").write_text(doc.markdown(out_dir))
    (out_dir / "report.html").write_text(doc.html(f"LeverLab study: {', '.join(c['engines'])} side by side"))
    slim = {k: v for k, v in c.items() if k != "analyses"}
    (out_dir / "compare.json").write_text(json.dumps(to_jsonable(slim), indent=1, default=str))
    return c
