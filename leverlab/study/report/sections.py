"""The study report's sections, one builder each, in the order the report prints them (SECTIONS).

Each builder appends its blocks to the document from the analysis (analysis.py) and a View of the few values
every section needs; none computes a figure the analysis does not hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leverlab.study.plan import LEVERS
from leverlab.study.report.doc import Doc
from leverlab.study.report.fmt import _m, fmt, pct, ratio, rx, status_text


@dataclass
class View:
    configs: list[dict[str, Any]]
    plan: dict[str, Any]
    cmax: int  # the sweep's top concurrency
    sweep_bucket: str
    workload: dict[str, Any]
    plots: dict[str, Path]
    price: float | None  # USD per device-hour (--price-per-hour): the cost column when given

    @classmethod
    def of(cls, a: dict[str, Any], plots: dict[str, Path]) -> View:
        plan = a["plan"]
        return cls(
            a["configs"],
            plan,
            max(plan.get("concurrency") or [1]),
            plan.get("sweep_bucket", "medium"),
            a.get("workload") or {},
            plots,
            a.get("price_per_hour"),
        )


def header(d: Doc, a: dict[str, Any], view: View) -> None:
    """Title, what ran where, the workload, and the count of findings by result."""
    configs = view.configs
    plan = view.plan
    sb = view.sweep_bucket
    wl = view.workload
    d.h(1, f"LeverLab study: {Path(a['model']).name} on {a['engine']}")
    ran = sum(c["status"] == "done" for c in configs)
    d.p(
        f"Plan **{plan['name']}**: {len(configs)} configurations ({ran} measured), each changing one lever from its "
        f"parent. Engine `{a['engine']}`, model `{a['model']}`. Measured memory read bandwidth "
        f"{fmt(a.get('bandwidth_gbs'), '.1f')} GB/s"
        + (f" ({a['bandwidth_threads']} thread(s), as the engine runs)" if a.get("bandwidth_threads") else "")
        + f". Started {a.get('started')}, finished {a.get('finished') or '–'}"
        + (f" ({fmt((a.get('elapsed_s') or 0) / 60, '.1f')} min" if a.get("elapsed_s") else "")
        + (f"; one-time setup {fmt(a.get('setup_s'), '.0f')} s apart" if a.get("setup_s") and a.get("elapsed_s") else "")
        + (")." if a.get("elapsed_s") else ".")
    )
    d.p(
        "Workload: "
        + ", ".join(
            f"{b} ({v.get('input_tokens')} tokens in, {v.get('output_len')} out, {len(v.get('prompts', []))} prompts)"
            for b, v in wl.items()
        )
        + f"; every bucket at concurrency 1, then the {sb} bucket at concurrency "
        + ", ".join(map(str, plan.get("concurrency") or []))
        + f". Latency figures below are the {sb} bucket at concurrency 1 unless stated; decode tok/s is the median "
        "per-request (output tokens - 1) / (E2E - TTFT), as the reference study's."
    )

    counts: dict[str, int] = {}
    for f in a["findings"]:
        counts[f["status"]] = counts.get(f["status"], 0) + 1
    d.p(
        "Findings of the reference study on this machine: "
        + ", ".join(f"{n} {k}" for k, n in counts.items())
        + ". Recommendations and the reasons for each finding are below the progression table."
    )


def progression(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    cmax = view.cmax
    d.h(2, "Progression")
    d.p(
        "Each row changes one lever from the configuration named in *vs*. Fidelity is against the baseline."
        + (
            f" Cost: dollars per million output tokens at the configuration's measured output rate at "
            f"concurrency {cmax}, at ${view.price:g} per device-hour (a TP=2 configuration pays for two)."
            if view.price
            else ""
        )
    )
    rows = []
    for c in configs:
        m, f, p = _m(c), c.get("fidelity") or {}, c.get("prediction") or {}
        agr = f.get("agreement") or {}
        kl = (f.get("kl") or {}).get("mean")
        rows.append(
            [
                c["name"],
                c["change"] + (f" (vs {c['parent']})" if c["parent"] else ""),
                fmt(m.get("e2e_p50_s")),
                fmt(m.get("e2e_tm95_s")),
                fmt(m.get("e2e_p99_s")),
                fmt(m.get("ttft_p50_ms"), ".0f"),
                fmt(m.get("decode_tok_s"), ".1f"),
                fmt(p.get("calibrated_tok_s") or p.get("roofline_tok_s"), ".1f") if p else "–",
                fmt(m.get("rps_cmax"), ".3f"),
                *([fmt(c.get("usd_per_mtok"), ".2f")] if view.price else []),
                pct(agr.get("share_identical")) if agr else "–",
                fmt(agr.get("mean_first_divergence"), ".1f") if agr else "–",
                fmt(f.get("perplexity"), ".2f"),
                fmt(kl, ".2g"),
                status_text(c),
            ]
        )
    d.table(
        [
            "config",
            "change",
            "P50 s",
            "TM95 s",
            "P99 s",
            "TTFT ms",
            "decode tok/s",
            "predicted tok/s (calibrated)",
            f"req/s @c{cmax}",
            *([f"$ / M tokens @c{cmax}"] if view.price else []),
            "greedy identical",
            "first divergence",
            "perplexity",
            "KL nats",
            "status",
        ],
        rows,
        cls="progression",
    )


def recommendation(d: Doc, a: dict[str, Any], view: View) -> None:
    d.h(2, "Recommendation")
    d.ul(
        [
            r["text"] if r["goal"] == "note" else f"For the {r['goal']}: {r['text']}"
            for r in a["recommendations"]
        ]
    )


def findings(d: Doc, a: dict[str, Any], view: View) -> None:
    d.h(2, "Findings of the reference study, on this machine")
    d.table(
        ["#", "finding", "result", "evidence", "why"],
        [
            [f["id"], f["title"], f["status"].upper(), f["evidence"] or "–", f["why"] or "–"]
            for f in a["findings"]
        ],
    )


def single_lever_tables(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    cmax = view.cmax
    d.h(2, "Single-lever tables")
    byn = {c["name"]: c for c in configs}
    for lever in LEVERS:
        steps = [c for c in configs if c["lever"] == lever]
        if not steps:
            continue
        d.h(3, lever.replace("_", " "))
        rows = []
        for c in steps:
            par = byn[c["parent"]]
            m, pm = _m(c), _m(par)
            pred = c.get("prediction") or {}
            agr = (c.get("fidelity") or {}).get("agreement") or {}
            rows.append(
                [
                    f"{par['levers'].describe(lever)} -> {c['levers'].describe(lever)}",
                    f"{par['name']} -> {c['name']}",
                    rx(ratio(m.get("e2e_p50_s"), pm.get("e2e_p50_s"))),
                    rx(ratio(m.get("decode_tok_s"), pm.get("decode_tok_s"))),
                    rx(pred.get("predicted_speedup_vs_parent")),
                    rx(ratio(m.get("rps_cmax"), pm.get("rps_cmax"))),
                    rx(pred.get("predicted_load_speedup_vs_parent")),
                    rx(ratio(m.get("ttft_p50_ms"), pm.get("ttft_p50_ms"))),
                    pct(agr.get("share_identical")) if agr else "–",
                    status_text(c),
                ]
            )
        d.table(
            [
                "change",
                "configs",
                "P50 latency",
                "decode tok/s (c=1)",
                "predicted (calibrated)",
                f"req/s @c{cmax}",
                "predicted (bytes x tokens/pass)",
                "TTFT",
                "greedy identical",
                "status",
            ],
            rows,
        )


def predictions(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    d.h(2, "Predicted against measured (the bandwidth model)")
    mf = a.get("model_facts")
    if mf:
        d.p(
            f"Bytes per pass = {mf['linear_params'] / 1e6:.1f}M matmul weights x bits/8 + "
            f"{mf.get('head_params', 0) / 1e6:.1f}M output-head weights (int8 under int8/int4, else the model "
            f"dtype) + {(mf['other_params'] - mf.get('head_params', 0)) / 1e6:.1f}M other embedding/norm weights "
            "in the model dtype + KV cache of "
            f"{fmt(a.get('prediction_context_tokens'), '.0f')} tokens of context; bandwidth "
            f"{fmt(a.get('bandwidth_gbs'), '.1f')} GB/s measured; tokens per pass from the server's counters "
            "(generated / (generated - accepted drafts)). Roofline = tokens per pass x bandwidth / bytes; "
            "calibrated = tokens per pass / (fixed cost + bytes / bandwidth), the fixed cost fitted once on the baseline."
        )
        if mf.get("moe"):
            d.p(
                "A mixture of experts: a pass reads only the experts its tokens chose. The matmul weights above count "
                "num_experts_per_tok experts per sparse layer, an estimate (right at one sequence, low for a batch). "
                "Where the server counted the experts each decode pass's router chose "
                "(leverlab_engine_moe_weight_bytes_read_total / leverlab_engine_moe_decode_passes_total), those "
                "measured weight bytes replace the estimate; MB / pass says which each row used."
            )
    rows = []
    for c in configs:
        p = c.get("prediction")
        if not p:
            continue
        rows.append(
            [
                c["name"],
                fmt(p["weight_bits"], ".1f"),
                fmt(p["bytes_per_pass"] / 1e6, ".1f") + _bytes_label(p),
                fmt(p["tokens_per_pass"], ".2f"),
                fmt(p["roofline_tok_s"], ".0f"),
                fmt(p.get("calibrated_tok_s"), ".1f"),
                fmt(p.get("measured_decode_tok_s"), ".1f"),
                pct(p.get("roofline_share")),
                fmt(p.get("predicted_speedup_vs_parent"), ".2f"),
                fmt(p.get("measured_speedup_vs_parent"), ".2f"),
                p.get("gap") or ("–" if p.get("measured_decode_tok_s") else "not measured"),
            ]
        )
    d.table(
        [
            "config",
            "weight bits",
            "MB / pass",
            "tokens / pass",
            "roofline tok/s",
            "calibrated tok/s",
            "measured tok/s",
            "of roofline",
            "predicted speedup vs parent",
            "measured speedup",
            "gap explained",
        ],
        rows,
    )


def _bytes_label(p: dict[str, Any]) -> str:
    """A mixture of experts' MB / pass: whether the weight bytes were measured from the router or estimated."""
    source = p.get("weight_bytes_source")
    return f" ({source})" if source in ("measured", "estimate") else ""


def fidelity(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    plan = view.plan
    d.h(2, "Fidelity against the baseline")
    sources = sorted({(c.get("fidelity") or {}).get("source") or "" for c in configs} - {""})
    n_fid = max([((c.get("fidelity") or {}).get("agreement") or {}).get("n", 0) for c in configs] + [0])
    d.p(
        f"Same {n_fid} prompts for every configuration; greedy (temperature 0) continuations "
        f"of {plan.get('fidelity_tokens')} tokens compared token by token; perplexity and KL(baseline || config) "
        "from the top-20 prompt logprobs at every prompt position. KL from top-k lists is a lower bound (tokens "
        "outside both lists merged into one bucket). Collected: "
        + ("; ".join(sources) or "–")
        + ". Speculative "
        "configurations are also run with speculation on and off in float32: they must agree exactly."
    )
    rows = []
    for c in configs:
        if c["status"] != "done":
            continue
        f = c.get("fidelity") or {}
        agr, kl, ex = f.get("agreement") or {}, f.get("kl") or {}, f.get("exactness")
        rows.append(
            [
                c["name"],
                f"{agr.get('identical', '–')}/{agr.get('n', '–')}" if agr else f.get("error", "–"),
                fmt(agr.get("mean_first_divergence"), ".1f") if agr else "–",
                fmt(f.get("perplexity"), ".3f") + " / " + fmt(f.get("perplexity_baseline"), ".3f"),
                fmt(kl.get("mean"), ".5f"),
                fmt(kl.get("max"), ".4f"),
                (
                    "not checked here (the short plan checks it where speculation changes; --full everywhere)"
                    if c["levers"].speculative
                    else "–"
                )
                if ex is None
                else (
                    f"exact ({ex['identical']}/{ex['n']})"
                    if ex["exact"]
                    else f"BUG: {ex['identical']}/{ex['n']} identical"
                ),
                f.get("logprobs_note") or f.get("unit", "tokens"),
            ]
        )
    d.table(
        [
            "config",
            "greedy identical",
            "mean first divergence",
            "perplexity (config / baseline)",
            "KL mean",
            "KL max",
            "speculation exactness (fp32)",
            "note",
        ],
        rows,
    )


def buckets(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    wl = view.workload
    d.h(2, "Latency per bucket at concurrency 1 (P50 s; TTFT ms)")
    buckets = list(wl)
    d.table(
        ["config"] + [f"{b} P50 s" for b in buckets] + [f"{b} TTFT ms" for b in buckets],
        [
            [c["name"]]
            + [fmt(((_m(c).get("single") or {}).get(b) or {}).get("e2e_p50_s")) for b in buckets]
            + [fmt(((_m(c).get("single") or {}).get(b) or {}).get("ttft_p50_ms"), ".0f") for b in buckets]
            for c in configs
            if _m(c)
        ],
    )


def sweep(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    plan = view.plan
    sb = view.sweep_bucket
    d.h(2, f"Concurrency sweep ({sb} bucket): P50 s / requests/s")
    cs = plan.get("concurrency") or []
    d.table(
        ["config"] + [f"c={k}" for k in cs],
        [
            [c["name"]]
            + [
                (
                    lambda g: (
                        f"{fmt(g.get('e2e_p50_s'))} / {fmt(g.get('request_throughput'), '.3f')}" if g else "–"
                    )
                )((_m(c).get("sweep") or {}).get(k) or (_m(c).get("sweep") or {}).get(str(k)))
                for k in cs
            ]
            for c in configs
            if _m(c)
        ],
    )


def plot_figures(d: Doc, a: dict[str, Any], view: View) -> None:
    plots = view.plots
    d.h(2, "Plots")
    d.img("Latency against concurrency, per configuration", plots["latency"])
    d.img("Latency-throughput Pareto chart", plots["pareto"])
    d.img("Predicted against measured decode rate", plots["predicted"])


def engines(d: Doc, a: dict[str, Any], view: View) -> None:
    d.h(2, "How each engine expresses the levers")
    engines = a.get("engines") or {
        a["engine"]: {"installed": None, "capabilities": a.get("engine_capabilities") or {}}
    }
    names = list(engines)
    d.p(
        f"This study ran on **{a['engine']}**. The same harness drives the others: "
        + "; ".join(f"`{n}`: {engines[n]['installed'] or 'available here'}" for n in names)
        + "."
    )
    d.table(
        ["lever"] + names,
        [[lever] + [engines[n]["capabilities"].get(lever, "–") for n in names] for lever in LEVERS],
    )


def substitutions(d: Doc, a: dict[str, Any], view: View) -> None:
    subs = [c for c in view.configs if c.get("substitution")]
    if subs:
        d.h(2, "Configurations run from the nearest parent")
        d.p(
            f"{a['engine']} cannot express a value these configurations inherit, so each ran with a sibling step's "
            "value of that lever instead (the first in plan order it can express; leverlab/study/substitute.py) "
            "and is compared with the step it then changes one lever from."
        )
        d.ul(
            [
                f"**{c['name']}** runs as {c['substitution']['label']}; compared with {c['parent']} "
                f"(plan parent {c['substitution']['plan_parent']})"
                for c in subs
            ]
        )


def not_run(d: Doc, a: dict[str, Any], view: View) -> None:
    notes = [c for c in view.configs if c["status"] in ("unavailable", "failed") or c.get("fidelity_error")]
    if notes:
        d.h(2, "Configurations that did not run, or ran only in part")
        for c in notes:
            d.p(f"**{c['name']}** ({c['change']}): {status_text(c)}")
            if c.get("fidelity_error"):
                d.pre(c["fidelity_error"][-1500:])


def run_log(d: Doc, a: dict[str, Any], view: View) -> None:
    configs = view.configs
    d.h(2, "Run log")
    d.p(
        f"{os.cpu_count()} CPU cores. The load average (1 min) at each configuration's start and end says how "
        "contended the machine was: above the core count, other jobs took CPU time from the server and the client."
    )
    d.table(
        ["config", "status", "started", "server start s", "duration s", "load avg start / end"],
        [
            [
                c["name"],
                c["status"],
                c.get("started_at") or "–",
                fmt(c.get("startup_s"), ".1f"),
                fmt(c.get("duration_s"), ".0f"),
                " / ".join(fmt(x, ".1f") for x in (c.get("load") or (None, None))),
            ]
            for c in configs
        ],
    )


def method(d: Doc, a: dict[str, Any], view: View) -> None:
    d.h(2, "Method")
    d.ul(
        [
            "Each configuration: its own server process, started, health-checked, warmed up (the harness's warm-up "
            "requests, not measured), benchmarked with `leverlab bench` (definitions as `vllm bench serve`), its "
            "Prometheus counters diffed around each phase, then stopped. Per-configuration results: `<config>/bench/`.",
            "TM95 is the mean after dropping the slowest 5% (nothing dropped under 20 requests).",
            "LeverLab configurations run in eager mode unless `--execution-mode compiled`: on this 2-core machine a "
            "compiled start costs ~30 s per configuration for ~1.3x decode speed on a 15M model; the plan compares "
            "levers, which eager holds fixed.",
            "Shared machine: figures are noisy; compare ratios within one study.",
        ]
    )


SECTIONS = (
    header,
    progression,
    recommendation,
    findings,
    single_lever_tables,
    predictions,
    fidelity,
    buckets,
    sweep,
    plot_figures,
    engines,
    substitutions,
    not_run,
    run_log,
    method,
)
