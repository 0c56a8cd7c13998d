"""The study's report: report.md and a self-contained report.html (plots embedded as base64 PNG, CSS inline),
both rendered from one list of blocks so they always say the same thing; plus analysis.json and plots/.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from leverlab.study.analysis import analyze, to_jsonable
from leverlab.study.plan import LEVERS

# ---- formatting helpers -------------------------------------------------------------------------------------


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
    return a / b if a and b else None


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


# ---- blocks -----------------------------------------------------------------------------------------------


class Doc:
    def __init__(self) -> None:
        self.blocks: list[tuple] = []

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[Any]], cls: str = "") -> None:
        self.blocks.append(("table", headers, [[str(x) for x in r] for r in rows], cls))

    def img(self, title: str, path: Path) -> None:
        self.blocks.append(("img", title, path))

    def pre(self, text: str) -> None:
        self.blocks.append(("pre", text))

    # -- renderers
    def markdown(self, base: Path) -> str:
        out: list[str] = []
        for b in self.blocks:
            kind = b[0]
            if kind == "h":
                out.append("#" * b[1] + " " + b[2])
            elif kind == "p":
                out.append(b[1])
            elif kind == "ul":
                out.append("\n".join(f"- {x}" for x in b[1]))
            elif kind == "table":
                headers, rows = b[1], b[2]
                esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
                lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "---|" * len(headers)]
                lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
                out.append("\n".join(lines))
            elif kind == "img":
                out.append(f"![{b[1]}]({b[2].relative_to(base).as_posix()})")
            elif kind == "pre":
                out.append("```\n" + b[1] + "\n```")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body: list[str] = []
        for b in self.blocks:
            kind = b[0]
            if kind == "h":
                body.append(f"<h{b[1]}>{_inline(b[2])}</h{b[1]}>")
            elif kind == "p":
                body.append(f"<p>{_inline(b[1])}</p>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in b[1]) + "</ul>")
            elif kind == "table":
                headers, rows, cls = b[1], b[2], b[3]
                th = "".join(f"<th>{_inline(x)}</th>" for x in headers)
                trs = "".join("<tr>" + "".join(f"<td>{_inline(x)}</td>" for x in r) + "</tr>" for r in rows)
                body.append(f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>')
            elif kind == "img":
                data = base64.b64encode(b[2].read_bytes()).decode()
                body.append(
                    f'<figure><img alt="{html.escape(b[1])}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{html.escape(b[1])}</figcaption></figure>"
                )
            elif kind == "pre":
                body.append(f"<pre>{html.escape(b[1])}</pre>")
        return HTML_PAGE.format(title=html.escape(title), body="\n".join(body))


def _inline(s: str) -> str:
    s = html.escape(s)
    s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
    s = re.sub(r"(?<![*\w])\*(\w[^*]*?)\*(?![*\w])", r"<em>\1</em>", s)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", s)


HTML_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; line-height: 1.45; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.88em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.55em; text-align: left; vertical-align: top; }}
th {{ background: #f0f3f7; }}
tbody tr:nth-child(even) {{ background: #fafafa; }}
table.progression td:nth-child(n+3) {{ text-align: right; white-space: nowrap; }}
table.progression td:last-child {{ text-align: left; white-space: normal; min-width: 14em; }}
figure {{ display: inline-block; margin: 0.5em 1em 1em 0; }}
img {{ max-width: 560px; border: 1px solid #ddd; }}
pre {{ background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
</style></head>
<body>
{body}
</body></html>
"""


# ---- plots ----------------------------------------------------------------------------------------------------


def write_plots(a: dict[str, Any], plot_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    done = [c for c in a["configs"] if _m(c).get("sweep")]
    paths: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for c in done:
        sw = _m(c)["sweep"]
        cs = sorted(int(k) for k in sw)
        ax.plot(
            cs,
            [sw[k]["e2e_p50_s"] if k in sw else sw[str(k)]["e2e_p50_s"] for k in cs],
            marker="o",
            label=c["name"],
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("P50 end-to-end latency (s)")
    ax.set_title(f"Latency against concurrency ({a['plan'].get('sweep_bucket', 'medium')} bucket)")
    ax.grid(alpha=0.3)
    if done:
        ax.legend(fontsize=7)
    paths["latency"] = _save(fig, plot_dir / "latency_vs_concurrency.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = []
    for c in done:
        sw = _m(c)["sweep"]
        xs = [v["request_throughput"] for v in sw.values()]
        ys = [v["e2e_p50_s"] for v in sw.values()]
        ax.scatter(xs, ys, label=c["name"], s=22)
        for k, x, y in zip(sw, xs, ys):
            ax.annotate(f"c{k}", (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
            pts.append((x, y))
    frontier = _pareto([p for p in pts if None not in p])
    if frontier:
        ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "k--", lw=0.8, label="Pareto frontier")
    ax.set_xlabel("requests/s")
    ax.set_ylabel("P50 end-to-end latency (s)")
    ax.set_title("Latency against throughput (lower right is better)")
    ax.grid(alpha=0.3)
    if done:
        ax.legend(fontsize=7)
    paths["pareto"] = _save(fig, plot_dir / "pareto.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs, ys, rs, names = [], [], [], []
    for c in a["configs"]:
        p = c.get("prediction") or {}
        if p.get("measured_decode_tok_s"):
            xs.append(p.get("calibrated_tok_s") or p["roofline_tok_s"])
            rs.append(p["roofline_tok_s"])
            ys.append(p["measured_decode_tok_s"])
            names.append(c["name"])
    if xs:
        ax.scatter(xs, ys, label="calibrated model (fixed cost + bytes / bandwidth)")
        ax.scatter(rs, ys, facecolors="none", edgecolors="gray", label="bandwidth roofline")
        for n, x, y in zip(names, xs, ys):
            ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        lo, hi = min(xs + ys + rs) * 0.8, max(xs + ys + rs) * 1.2
        ax.plot([lo, hi], [lo, hi], "k:", lw=0.8, label="measured = predicted")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_xlabel("predicted decode tok/s (one stream)")
    ax.set_ylabel("measured decode tok/s (P50, c=1)")
    ax.set_title("Predicted against measured")
    ax.grid(alpha=0.3)
    paths["predicted"] = _save(fig, plot_dir / "predicted_vs_measured.png")
    return paths


def _pareto(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both throughput (higher) and latency (lower), by throughput."""
    front = [p for p in pts if not any(q[0] >= p[0] and q[1] <= p[1] and q != p for q in pts)]
    return sorted(set(front))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---- the document ------------------------------------------------------------------------------------------------


def build(a: dict[str, Any], out_dir: Path, plots: dict[str, Path]) -> Doc:
    d = Doc()
    configs = a["configs"]
    plan = a["plan"]
    cmax = max(plan.get("concurrency") or [1])
    sb = plan.get("sweep_bucket", "medium")
    d.h(1, f"LeverLab study: {Path(a['model']).name} on {a['engine']}")
    ran = sum(c["status"] == "done" for c in configs)
    d.p(
        f"Plan **{plan['name']}**: {len(configs)} configurations ({ran} measured), each changing one lever from its "
        f"parent. Engine `{a['engine']}`, model `{a['model']}`. Measured memory read bandwidth "
        f"{fmt(a.get('bandwidth_gbs'), '.1f')} GB/s"
        + (f" ({a['bandwidth_threads']} thread(s), as the engine runs)" if a.get("bandwidth_threads") else "")
        + f". Started {a.get('started')}, finished {a.get('finished') or '–'}"
        + (f" ({fmt((a.get('elapsed_s') or 0) / 60, '.1f')} min)." if a.get("elapsed_s") else ".")
    )
    wl = a.get("workload") or {}
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
    d.h(2, "Progression")
    d.p("Each row changes one lever from the configuration named in *vs*. Fidelity is against the baseline.")
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
            "greedy identical",
            "first divergence",
            "perplexity",
            "KL nats",
            "status",
        ],
        rows,
        cls="progression",
    )

    d.h(2, "Recommendation")
    d.ul(
        [
            r["text"] if r["goal"] == "note" else f"For the {r['goal']}: {r['text']}"
            for r in a["recommendations"]
        ]
    )

    d.h(2, "Findings of the reference study, on this machine")
    d.table(
        ["#", "finding", "result", "evidence", "why"],
        [
            [f["id"], f["title"], f["status"].upper(), f["evidence"] or "–", f["why"] or "–"]
            for f in a["findings"]
        ],
    )

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
    rows = []
    for c in configs:
        p = c.get("prediction")
        if not p:
            continue
        rows.append(
            [
                c["name"],
                fmt(p["weight_bits"], ".1f"),
                fmt(p["bytes_per_pass"] / 1e6, ".1f"),
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
                "–"
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

    d.h(2, "Plots")
    d.img("Latency against concurrency, per configuration", plots["latency"])
    d.img("Latency-throughput Pareto chart", plots["pareto"])
    d.img("Predicted against measured decode rate", plots["predicted"])

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
    notes = [c for c in configs if c["status"] in ("unavailable", "failed") or c.get("fidelity_error")]
    if notes:
        d.h(2, "Configurations that did not run, or ran only in part")
        for c in notes:
            d.p(f"**{c['name']}** ({c['change']}): {status_text(c)}")
            if c.get("fidelity_error"):
                d.pre(c["fidelity_error"][-1500:])
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
    return d


def write_report(out_dir: Path) -> dict[str, Any]:
    a = analyze(out_dir)
    plots = write_plots(a, out_dir / "plots")
    doc = build(a, out_dir, plots)
    (out_dir / "report.md").write_text(doc.markdown(out_dir))
    (out_dir / "report.html").write_text(doc.html(f"LeverLab study: {Path(a['model']).name}"))
    (out_dir / "analysis.json").write_text(json.dumps(to_jsonable(a), indent=1, default=str))
    return a
