"""`leverlab bench compare A B`: two results side by side, every figure with its ratio B / A.

Groups are matched by name ("single/medium", "sweep/medium/c4", ...); a group in only one result is listed
as unmatched. A ratio below 1 on a latency, or above 1 on a throughput, means B is better.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from leverlab.bench.report import _jsonable, flatten_group, fmt

HEADLINE = (
    "e2e_s_p50",
    "e2e_s_p99",
    "e2e_s_tm95",
    "ttft_ms_p50",
    "tpot_ms_p50",
    "itl_ms_p50",
    "decode_tok_s_p50",
    "output_throughput",
    "request_throughput",
)
_LABELS = ("name", "kind", "bucket", "concurrency", "request_rate")


def load_summary(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise FileNotFoundError(f"no summary.json at {p}")
    return json.loads(p.read_text())


def ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or isinstance(a, bool):
        return None
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or a == 0:
        return None
    return b / a


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    ga = {g["name"]: flatten_group(g) for g in a["groups"]}
    gb = {g["name"]: flatten_group(g) for g in b["groups"]}
    groups = []
    for name in [n for n in ga if n in gb]:
        ra, rb = ga[name], gb[name]
        figures = {}
        for k in [k for k in ra if k not in _LABELS] + [k for k in rb if k not in ra and k not in _LABELS]:
            figures[k] = {"a": ra.get(k), "b": rb.get(k), "ratio": ratio(ra.get(k), rb.get(k))}
        groups.append({"name": name, "figures": figures})
    return {
        "a": {
            "model": a["manifest"]["server"]["model"],
            "base_url": a["manifest"]["server"]["base_url"],
            "started": a["manifest"].get("started"),
            "version": a["manifest"]["server"].get("version"),
        },
        "b": {
            "model": b["manifest"]["server"]["model"],
            "base_url": b["manifest"]["server"]["base_url"],
            "started": b["manifest"].get("started"),
            "version": b["manifest"]["server"].get("version"),
        },
        "groups": groups,
        "only_in_a": [n for n in ga if n not in gb],
        "only_in_b": [n for n in gb if n not in ga],
    }


def markdown(c: dict[str, Any], label_a: str, label_b: str) -> str:
    out = [
        f"# Compare: A = {label_a}, B = {label_b}\n",
        f"- A: {c['a']['model']} @ {c['a']['base_url']} ({c['a']['started']})",
        f"- B: {c['b']['model']} @ {c['b']['base_url']} ({c['b']['started']})",
        "- ratio = B / A (below 1 on a latency, above 1 on a throughput: B is better)\n",
    ]
    for g in c["groups"]:
        out.append(f"## {g['name']}\n")
        out.append("| figure | A | B | B/A |\n|---|---|---|---|")
        for k, f in g["figures"].items():
            out.append(f"| {k} | {fmt(f['a'], 4)} | {fmt(f['b'], 4)} | {fmt(f['ratio'], 3)} |")
        out.append("")
    if c["only_in_a"] or c["only_in_b"]:
        out.append(f"Unmatched groups: only in A {c['only_in_a']}, only in B {c['only_in_b']}\n")
    return "\n".join(out)


def render(c: dict[str, Any], all_figures: bool = False):
    from rich.table import Table

    t = Table(title="B / A (A: {}, B: {})".format(c["a"]["model"], c["b"]["model"]))
    for col in ("group", "figure", "A", "B", "B/A"):
        t.add_column(col, justify="left" if col in ("group", "figure") else "right", no_wrap=True)
    for g in c["groups"]:
        for k, f in g["figures"].items():
            if all_figures or k in HEADLINE:
                t.add_row(g["name"], k, fmt(f["a"], 3), fmt(f["b"], 3), fmt(f["ratio"], 3))
    return t


def run_compare(
    a_path: str, b_path: str, out: str | None = None, all_figures: bool = False, console=None
) -> dict:
    c = compare(load_summary(a_path), load_summary(b_path))
    out_dir = Path(out) if out else (Path(a_path) if Path(a_path).is_dir() else Path(a_path).parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{Path(b_path).resolve().name}"
    (out_dir / f"{stem}.json").write_text(json.dumps(_jsonable(c), indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(c, str(a_path), str(b_path)))
    if console is not None:
        console.print(render(c, all_figures))
        if c["only_in_a"] or c["only_in_b"]:
            console.print(f"unmatched groups: only in A {c['only_in_a']}, only in B {c['only_in_b']}")
        console.print(f"written: {out_dir / (stem + '.md')}, {out_dir / (stem + '.json')}")
    c["files"] = [str(out_dir / f"{stem}.json"), str(out_dir / f"{stem}.md")]
    return c
