"""The reference study's findings about speculative decoding (n-gram, a separate draft model, exactness),
checked against this study's numbers; findings.py runs them with the others."""

from __future__ import annotations

from typing import Any

from leverlab.study.findings_common import (
    MARGIN,
    NOT_REPRODUCED,
    NOT_TESTED,
    PARTLY,
    REPRODUCED,
    by_name,
    finding,
    metrics_of,
    unavailable,
)


def _no_spec_ancestor(a: dict[str, Any], c: dict[str, Any]) -> dict[str, Any] | None:
    byn = by_name(a)
    p = byn.get(c["parent"] or "")
    while p is not None and p["levers"].speculative:
        p = byn.get(p["parent"] or "")
    return p


def _spec_steps(a: dict[str, Any], method: str, adaptive: bool) -> list[dict[str, Any]]:
    return [
        c
        for c in a["configs"]
        if c["levers"].speculative
        and c["levers"].speculative.get("method") == method
        and bool(c["levers"].speculative.get("adaptive")) == adaptive
    ]


def check_ngram(a: dict[str, Any]) -> dict[str, str]:
    title = "n-gram speculation helps at concurrency 1 and hurts under load; the adaptive mode does not"
    plain = _spec_steps(a, "ngram", False)
    if not plain:
        return finding("3", title, NOT_TESTED, "", "the plan has no n-gram step")
    c = plain[0]
    ref = _no_spec_ancestor(a, c)
    if c["status"] != "done" or ref is None or ref["status"] != "done":
        return finding(
            "3", title, NOT_TESTED, "", unavailable(c) if c["status"] != "done" else "its parent did not run"
        )
    bucket = "decode" if "decode" in (metrics_of(c).get("single") or {}) else None

    def lat(x):
        return (
            ((metrics_of(x).get("single") or {}).get(bucket) or {}).get("e2e_p50_s")
            if bucket
            else metrics_of(x).get("e2e_p50_s")
        )

    l_ref, l_c = lat(ref), lat(c)
    r_ref, r_c = metrics_of(ref).get("rps_cmax"), metrics_of(c).get("rps_cmax")
    cmax = metrics_of(c).get("c_max")
    helps = l_c is not None and l_ref is not None and l_c < l_ref * (1 - MARGIN)
    hurts = r_c is not None and r_ref is not None and r_c < r_ref * (1 - MARGIN)
    acc = metrics_of(c).get("acceptance_rate")
    ev = [
        f"{bucket or 'sweep'}-bucket P50 at c=1: {ref['name']} {l_ref:.2f} s, {c['name']} {l_c:.2f} s"
        if l_ref and l_c
        else "no c=1 latency",
        f"req/s at c={cmax}: {r_ref:.3f} vs {r_c:.3f}" if r_ref and r_c else "no sweep",
    ]
    if acc is not None:
        ev.append(
            f"draft acceptance {acc:.0%}, {(c.get('prediction') or {}).get('tokens_per_pass', 1):.2f} tokens per pass"
        )
    adaptive = _spec_steps(a, "ngram", True)
    adaptive_ok = None
    if adaptive and adaptive[0]["status"] == "done":
        ad = adaptive[0]
        r_ad, l_ad = metrics_of(ad).get("rps_cmax"), lat(ad)
        if r_ad and r_ref:
            adaptive_ok = r_ad >= r_ref * (1 - MARGIN)
            ev.append(
                f"adaptive: c=1 P50 {l_ad:.2f} s, req/s at c={cmax} {r_ad:.3f} ({r_ad / r_ref:.2f}x {ref['name']})"
            )
    elif adaptive:
        ev.append(unavailable(adaptive[0]))
    evidence = "; ".join(ev)
    why = []
    if not helps:
        why.append(
            "at c=1 n-gram did not lower latency: its verify pass costs more than a plain one on a CPU and "
            + (
                "few drafts were accepted"
                if acc is not None and acc < 0.3
                else "the gain per accepted token is small"
            )
        )
    if not hurts:
        why.append(f"under load (c={cmax}) it did not cost throughput")
        if acc is not None and acc >= 0.7:
            why.append(
                f"{acc:.0%} of drafts were accepted (greedy continuations of a small model repeat themselves), "
                "so drafts are nearly free tokens even in a batch"
            )
    if adaptive_ok is False:
        why.append("the adaptive mode lost throughput under load")
    if adaptive_ok is None:
        why.append("the adaptive mode was not measured")
    if helps and hurts and adaptive_ok:
        return finding(
            "3",
            title,
            REPRODUCED,
            evidence,
            "speculation trades spare compute for fewer passes: plenty at c=1, none under load",
        )
    status = PARTLY if (helps or hurts) else NOT_REPRODUCED
    return finding("3", title, status, evidence, "; ".join(why))


def check_exactness(a: dict[str, Any]) -> dict[str, str]:
    title = "Speculative decoding says exactly what the model says (greedy, float32)"
    spec = [c for c in a["configs"] if c["levers"].speculative and c["status"] == "done"]
    if not spec:
        return finding("S", title, NOT_TESTED, "", "no speculative configuration ran")
    ev, bad, missing = [], [], []
    for c in spec:
        ex = (c.get("fidelity") or {}).get("exactness")
        if ex is None:
            missing.append(c["name"])
            continue
        ev.append(f"{c['name']}: {ex['identical']}/{ex['n']} identical")
        if not ex["exact"]:
            bad.append(c["name"])
    if bad:
        return finding(
            "S",
            title,
            NOT_REPRODUCED,
            "; ".join(ev),
            f"BUG: speculation changed greedy tokens in {', '.join(bad)}",
        )
    if not ev:
        return finding(
            "S", title, NOT_TESTED, "", f"no exactness check for {', '.join(missing)} (fidelity over HTTP)"
        )
    return finding(
        "S", title, REPRODUCED, "; ".join(ev), "verification accepts a draft only where the model agrees"
    )


def check_separate_draft(a: dict[str, Any]) -> dict[str, str]:
    title = "A separate draft model helps single-stream but hurts under load; a fused trained head holds up batched"
    draft = next(
        (c for c in a["configs"] if (c["levers"].speculative or {}).get("method") == "draft_model"), None
    )
    eagle = next((c for c in a["configs"] if (c["levers"].speculative or {}).get("method") in ("eagle", "eagle3")), None)
    if draft is None and eagle is None:
        return finding("3b", title, NOT_TESTED, "", "the plan has no draft-model or EAGLE step")
    ran = [c for c in (draft, eagle) if c is not None and c["status"] == "done"]
    skipped = [unavailable(c) for c in (draft, eagle) if c is not None and c["status"] != "done"]
    if len(ran) < 2:
        ev = []
        for c in ran:
            ref = _no_spec_ancestor(a, c)
            r, rr = metrics_of(c).get("rps_cmax"), metrics_of(ref).get("rps_cmax")
            if r and rr:
                ev.append(f"{c['name']}: req/s at c={metrics_of(c).get('c_max')} {r / rr:.2f}x {ref['name']}")
        return finding("3b", title, NOT_TESTED, "; ".join(ev), "; ".join(skipped))
    ev = []
    for c in ran:
        ref = _no_spec_ancestor(a, c)
        r, rr = metrics_of(c).get("rps_cmax"), metrics_of(ref).get("rps_cmax")
        ev.append(
            f"{c['name']}: req/s at c={metrics_of(c).get('c_max')} {r / rr:.2f}x {ref['name']}"
            if r and rr
            else c["name"]
        )
    r_d, r_e = metrics_of(draft).get("rps_cmax"), metrics_of(eagle).get("rps_cmax")
    ok = r_d is not None and r_e is not None and r_e > r_d
    return finding("3b", title, REPRODUCED if ok else NOT_REPRODUCED, "; ".join(ev), "")
