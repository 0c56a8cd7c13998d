"""The study's report: report.md and a self-contained report.html rendered from one document (doc.py), its
sections built one function each (sections.py), plots (plots.py); plus analysis.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leverlab.study.analysis import analyze, to_jsonable
from leverlab.study.report.doc import Doc
from leverlab.study.report.plots import write_plots
from leverlab.study.report.sections import SECTIONS, View


def build(a: dict[str, Any], plots: dict[str, Path]) -> Doc:
    d, view = Doc(), View.of(a, plots)
    for section in SECTIONS:
        section(d, a, view)
    return d


def write_report(out_dir: Path, price_per_hour: float | None = None) -> dict[str, Any]:
    a = analyze(out_dir, price_per_hour)
    plots = write_plots(a, out_dir / "plots")
    doc = build(a, plots)
    (out_dir / "report.md").write_text(doc.markdown(out_dir))
    (out_dir / "report.html").write_text(doc.html(f"LeverLab study: {Path(a['model']).name}"))
    (out_dir / "analysis.json").write_text(json.dumps(to_jsonable(a), indent=1, default=str))
    return a


__all__ = ["Doc", "build", "write_report"]
