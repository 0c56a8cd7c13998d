"""Number formatting shared by the report's sections and the comparison report ('–' for what is missing)."""

from __future__ import annotations

import math
from typing import Any


def fmt(x: Any, spec: str = ".2f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def rx(x: Any) -> str:
    """A ratio as '1.23x', or '–' when there is none."""
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.2f}x"


def pct(x: Any) -> str:
    return fmt(None if x is None else 100 * x, ".0f") + ("%" if x is not None else "")


def ratio(a: Any, b: Any) -> float | None:
    """a / b, or None when either is missing, zero or not a number."""
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and a and b else None


def _m(c: dict[str, Any]) -> dict[str, Any]:
    return c.get("metrics") or {}


def status_text(c: dict[str, Any]) -> str:
    s = c["status"]
    if s == "unavailable":
        return f"not available on this engine: {c.get('reason')}"
    if s == "failed":
        return f"FAILED: {c.get('reason')}"
    if c.get("bug"):
        return "BUG: speculation changed greedy tokens"
    notes = []
    errs = (c.get("metrics") or {}).get("request_errors")
    if errs:
        notes.append(f"{errs} requests failed")
    if c.get("fidelity_error"):
        notes.append("fidelity failed")
    if s != "done":
        return s
    return "ok" + (f" ({', '.join(notes)})" if notes else "")
