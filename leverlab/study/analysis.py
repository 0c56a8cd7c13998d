"""Compiles a study folder into numbers: per configuration its latency/throughput figures (from the harness's
summary.json), its counters, its fidelity against the baseline and its bandwidth-model prediction; then the
findings and the recommendations. Pure reading and arithmetic: the report only formats what this returns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from leverlab.bench import prometheus
from leverlab.study import fidelity as F
from leverlab.study.plan import Levers, Step


def load_steps(state: dict[str, Any]) -> list[Step]:
    return [
        Step(
            s["name"],
            s["parent"],
            s["lever"],
            Levers(**s["levers"]),
            s.get("note", ""),
            tuple(s["single_buckets"]) if s.get("single_buckets") is not None else None,
        )
        for s in state["plan"]["steps"]
    ]


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _counter(deltas: dict[str, float] | None, needle: str, exclude: tuple[str, ...] = ()) -> float | None:
    """Sum of the counter deltas whose name contains needle; engine-side counters win over server-side ones
    when both exist (LeverLab exports generation tokens from both, so they must not be added)."""
    if not deltas:
        return None
    hits = {k: v for k, v in deltas.items() if needle in k.split("{")[0] and not any(e in k for e in exclude)}
    if not hits:
        return None
    engine = {k: v for k, v in hits.items() if "_engine_" in k}
    return sum((engine or hits).values())


def config_metrics(summary: dict[str, Any], sweep_bucket: str) -> dict[str, Any]:
    groups = {g["name"]: g for g in summary["groups"]}
    m: dict[str, Any] = {"single": {}, "sweep": {}}
    for g in groups.values():
        if g["kind"] == "single":
            m["single"][g["bucket"]] = {
                "e2e_p50_s": _num(g["e2e_s"]["p50"]),
                "e2e_tm95_s": _num(g["e2e_s"]["tm95"]),
                "e2e_p99_s": _num(g["e2e_s"]["p99"]),
                "ttft_p50_ms": _num(g["ttft_ms"]["p50"]),
                "decode_tok_s": _num(g["decode_tok_s"]["p50"]),
                "input_tokens": _num(g["input_tokens"]["mean"]),
                "output_tokens": _num(g["output_tokens"]["mean"]),
                "errors": g["errors"],
            }
        elif g["kind"] == "sweep":
            c = int(g["concurrency"])
            m["sweep"][c] = {
                "e2e_p50_s": _num(g["e2e_s"]["p50"]),
                "e2e_p99_s": _num(g["e2e_s"]["p99"]),
                "ttft_p50_ms": _num(g["ttft_ms"]["p50"]),
                "request_throughput": _num(g["request_throughput"]),
                "output_throughput": _num(g["output_throughput"]),
                "errors": g["errors"],
            }
    head = m["single"].get(sweep_bucket) or next(iter(m["single"].values()), {})
    m.update(
        {k: head.get(k) for k in ("e2e_p50_s", "e2e_tm95_s", "e2e_p99_s", "ttft_p50_ms", "decode_tok_s")}
    )
    if m["sweep"]:
        cmax = max(m["sweep"])
        m["c_max"] = cmax
        m["rps_cmax"] = m["sweep"][cmax]["request_throughput"]
        m["out_tok_s_cmax"] = m["sweep"][cmax]["output_throughput"]
    # The sweep bucket's c=1 group: the same requests as decode_tok_s above (acceptance differs by bucket);
    # all c=1 groups together when that one has no counters.
    single_d: dict[str, float] = {}
    picked = [g for g in summary["groups"] if g["kind"] == "single" and g["bucket"] == sweep_bucket]
    if not any(((g.get("prometheus") or {}).get("deltas")) for g in picked):
        picked = [g for g in summary["groups"] if g["kind"] == "single"]
    for g in picked:
        for k, v in (((g.get("prometheus") or {}).get("deltas")) or {}).items():
            single_d[k] = single_d.get(k, 0.0) + v
    m["generated"] = _counter(single_d, "generation_tokens")
    m["accepted"] = _counter(single_d, "accepted_tokens", exclude=("pos",))
    m["drafted"] = _counter(single_d, "draft_tokens")
    # Tensor parallel: seconds rank 0 spent in all-reduces, and its steps (leverlab_engine_tp_*_total).
    ar, tp_steps = _counter(single_d, "tp_allreduce_seconds"), _counter(single_d, "tp_steps")
    m["allreduce_s_per_pass"] = ar / tp_steps if ar is not None and tp_steps else None
    # Mixture of experts: weight bytes per decode pass, counted from the router's choices (leverlab_engine_moe_*).
    m["weight_bytes_per_pass"] = prometheus.moe_bytes_per_pass(single_d)
    m["acceptance_rate"] = (
        (m["accepted"] / m["drafted"]) if m["accepted"] is not None and m["drafted"] else None
    )
    # Under load: the highest concurrency's counters (the adaptive mode drafts less there).
    top = [g for g in summary["groups"] if g["kind"] == "sweep" and g["concurrency"] == m.get("c_max")]
    top_d = (((top[0].get("prometheus") or {}).get("deltas")) or {}) if top else {}
    m["generated_cmax"] = _counter(top_d, "generation_tokens")
    m["accepted_cmax"] = _counter(top_d, "accepted_tokens", exclude=("pos",))
    m["weight_bytes_per_pass_cmax"] = prometheus.moe_bytes_per_pass(top_d)
    run_h = ((summary.get("prometheus") or {}).get("highlights")) or {}
    m["prefix_cache_hit_rate"] = run_h.get("prefix_cache_hit_rate")
    m["request_errors"] = sum(g["errors"] for g in summary["groups"])
    m["version"] = (summary.get("manifest", {}).get("server") or {}).get("version")
    return m


def analyze(out_dir: Path, price_per_hour: float | None = None) -> dict[str, Any]:
    """price_per_hour: USD per device-hour for the cost figures (default: the one the study ran with, if any)."""
    from leverlab.study import findings, predict, recommend

    state = json.loads((out_dir / "study.json").read_text())
    if price_per_hour is None:
        price_per_hour = state.get("price_per_hour")
    steps = load_steps(state)
    plan = state["plan"]
    sweep_bucket = plan.get("sweep_bucket", "medium")
    configs: list[dict[str, Any]] = []
    for s in steps:
        rec = state["configs"].get(s.name, {"status": "pending"})
        # A substitution (leverlab/study/substitute.py): the configuration ran with a stand-in for a value its
        # engine cannot express, and is compared with the step it then changes one lever from.
        sub = rec.get("substitution")
        c: dict[str, Any] = {
            "name": s.name,
            "parent": sub["parent"] if sub else s.parent,
            "lever": s.lever,
            "change": s.change + (f"; runs as {sub['label']}" if sub else ""),
            "note": s.note,
            "levers": Levers(**sub["levers"]) if sub else s.levers,
            "substitution": sub,
            "status": rec.get("status", "pending"),
            "reason": rec.get("reason"),
            "startup_s": rec.get("startup_s"),
            "duration_s": rec.get("duration_s"),
            "fidelity_error": rec.get("fidelity_error"),
            "load": (rec.get("load_start"), rec.get("load_end")),
            "started_at": rec.get("started"),
        }
        summary_path = out_dir / s.name / "bench" / "summary.json"
        if c["status"] == "done" and summary_path.is_file():
            c["metrics"] = config_metrics(json.loads(summary_path.read_text()), sweep_bucket)
            agent_path = out_dir / s.name / "bench-agent" / "summary.json"
            if agent_path.is_file():  # the agent workload (finding J): its c=1 pass and sweep
                c["metrics"]["agent"] = config_metrics(json.loads(agent_path.read_text()), "agent")
        configs.append(c)
    base = configs[0]
    base_fid = _load_fid(out_dir, base["name"]) if base["status"] == "done" else None
    for c in configs:
        if c["status"] != "done":
            continue
        fid = _load_fid(out_dir, c["name"])
        if fid is None:
            c["fidelity"] = {"error": c.get("fidelity_error") or "no fidelity samples"}
        elif base_fid is None:
            c["fidelity"] = {"error": "the baseline has no fidelity samples to compare with"}
        else:
            c["fidelity"] = F.compare(base_fid, fid)
        ex = (c.get("fidelity") or {}).get("exactness")
        c["bug"] = bool(ex is not None and not ex["exact"])
    # Predictions
    facts = None
    try:
        facts = predict.ModelFacts.from_folder(state["model"])
    except Exception as e:  # noqa: BLE001 - e.g. a GGUF file: no HF config to read
        state["predict_error"] = str(e)
    preds: dict[str, Any] = {}
    wl = _workload(out_dir, state)
    ctx_bucket = wl.get(sweep_bucket) or next(iter(wl.values()), {"input_tokens": 0, "output_len": 0})
    context = ctx_bucket.get("input_tokens", 0) + ctx_bucket.get("output_len", 0) / 2
    if facts is not None:
        rows = []
        for c in configs:
            m = c.get("metrics") or {}
            rows.append(
                {
                    "name": c["name"],
                    "parent": c["parent"],
                    "levers": c["levers"],
                    "measured_decode_tok_s": m.get("decode_tok_s"),
                    "generated": m.get("generated"),
                    "accepted": m.get("accepted"),
                    "allreduce_s_per_pass": m.get("allreduce_s_per_pass"),
                    "generated_load": m.get("generated_cmax"),
                    "accepted_load": m.get("accepted_cmax"),
                    "measured_rps_load": m.get("rps_cmax"),
                    "weight_bytes_per_pass": m.get("weight_bytes_per_pass"),
                    "weight_bytes_per_pass_load": m.get("weight_bytes_per_pass_cmax"),
                }
            )
        cmax = max(plan.get("concurrency") or [1])
        preds = predict.predict_all(
            rows, facts, state["bandwidth_gbs"], context, batch=cmax, facts_of=_facts_of(facts, predict)
        )
    for c in configs:
        c["prediction"] = preds.get(c["name"])
        c["usd_per_mtok"] = recommend.usd_per_million_tokens(c, price_per_hour)
    result = {
        "model": state["model"],
        "engine": state["engine"],
        "engine_capabilities": state.get("engine_capabilities"),
        "host": state.get("host"),
        "run_id": state.get("run_id"),
        "bandwidth_gbs": state.get("bandwidth_gbs"),
        "bandwidth_threads": state.get("bandwidth_threads"),
        "plan": plan,
        "workload": wl,
        "prediction_context_tokens": context,
        "model_facts": None if facts is None else facts.__dict__,
        "configs": configs,
        "started": state.get("started"),
        "finished": state.get("finished"),
        "elapsed_s": state.get("elapsed_s"),
        "setup_s": state.get("setup_s"),
        "price_per_hour": price_per_hour,
    }
    result["engines"] = engine_table()
    result["findings"] = findings.check_all(result)
    result["recommendations"] = recommend.recommend(result)
    return result


def _facts_of(facts, predict):
    """Levers -> the facts of the model they serve (the model lever's folder; else the study's)."""
    from leverlab.study.engines.base import resolve

    cache: dict[str, Any] = {}

    def of(lv: Levers):
        if not lv.model:
            return facts
        if lv.model not in cache:
            path = resolve(lv.model)
            cache[lv.model] = predict.ModelFacts.from_folder(str(path)) if path else facts
        return cache[lv.model]

    return of


def engine_table() -> dict[str, dict[str, Any]]:
    """Every engine adapter: whether it runs here, and how it expresses each lever (or why it cannot)."""
    from leverlab.study.engines import ENGINES, get_engine

    out = {}
    for name in ENGINES:
        try:
            e = get_engine(name)
            out[name] = {"installed": e.installed(), "capabilities": e.capabilities()}
        except Exception as ex:  # noqa: BLE001
            out[name] = {"installed": f"adapter failed: {ex}", "capabilities": {}}
    return out


def _workload(out_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The study's prompt set: its own copy in the folder first (study.json's path may be relative to where the
    study ran, and folders move: `study compare` reads two of them)."""
    for p in (out_dir / "workload.json", Path(state.get("workload") or "")):
        if p.is_file():
            return json.loads(p.read_text())["buckets"]
    return {}


def _load_fid(out_dir: Path, name: str) -> dict[str, Any] | None:
    p = out_dir / name / "fidelity-samples.json"
    return json.loads(p.read_text()) if p.is_file() else None


def to_jsonable(x: Any) -> Any:
    if isinstance(x, Levers):
        return x.__dict__
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
