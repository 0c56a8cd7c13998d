"""What every findings check shares: the statuses, the thresholds, and reading the analysis (configs by name,
their metrics, why a step did not run). findings.py and findings_spec.py build on it."""

from __future__ import annotations

from typing import Any

REPRODUCED, PARTLY, NOT_REPRODUCED, NOT_TESTED = "reproduced", "partly", "not reproduced", "not tested"
# Finding 1: output tokens must cost at least this many times more latency per token than input tokens.
OUTPUT_VS_INPUT_MIN = 5.0
# "Helps"/"hurts": a change beyond this relative margin (shared machines are noisy).
MARGIN = 0.03


def finding(id_: str, title: str, status: str, evidence: str, why: str = "") -> dict[str, str]:
    return {"id": id_, "title": title, "status": status, "evidence": evidence, "why": why}


def by_name(a: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in a["configs"]}


def metrics_of(c: dict[str, Any] | None) -> dict[str, Any]:
    return (c or {}).get("metrics") or {}


def unavailable(c: dict[str, Any]) -> str:
    return f"{c['name']} {c['status']}" + (f": {c['reason']}" if c.get("reason") else "")


def ran_step(a: dict[str, Any], lever: str, wanted, absent: str) -> tuple[dict[str, Any], dict[str, Any]] | str:
    """The plan's first step that changes `lever` to a value `wanted(levers)` accepts, and its parent, when both
    ran; else why not (`absent` when the plan has no such step), for a NOT TESTED finding."""
    steps = [c for c in a["configs"] if c["lever"] == lever and wanted(c["levers"])]
    if not steps:
        return absent
    c = steps[0]
    p = by_name(a)[c["parent"]]
    if c["status"] != "done" or p["status"] != "done":
        return unavailable(c if c["status"] != "done" else p)
    return c, p
