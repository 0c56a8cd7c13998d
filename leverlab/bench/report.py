"""Results: the terminal table, and the results folder.

records.jsonl   one line per request (warm-up included, group "warmup")
summary.json    manifest + per-group figures + Prometheus deltas
summary.csv     one row per group, figures flattened (ttft_ms_p50, e2e_s_tm95, ...)
report.md       tables a person reads: single-request latency per bucket, the sweep, where the time went
plots/*.png     latency and throughput against concurrency (or rate), TTFT and ITL distributions
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from leverlab.bench.config import BenchResult
from leverlab.bench.records import RequestRecord

STAT_KEYS = (
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "e2e_s",
    "decode_tok_s",
    "input_tokens",
    "output_tokens",
)
SCALAR_KEYS = (
    "requests",
    "completed",
    "errors",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "good_requests",
    "output_len_mismatches",
    "cached_prompt_tokens",
    "cached_prompt_fraction",
)
PLOT_FILES = (
    "latency_vs_load.png",
    "throughput_vs_load.png",
    "ttft_distribution.png",
    "itl_distribution.png",
)


def flatten_group(g: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {k: g.get(k) for k in ("name", "kind", "bucket", "concurrency", "request_rate")}
    row.update({k: g.get(k) for k in SCALAR_KEYS})
    for k in STAT_KEYS:
        for s, v in (g.get(k) or {}).items():
            row[f"{k}_{s}"] = v
    split = g.get("server_timings_ms") or {}
    for part, v in (split.get("mean_ms") or {}).items():
        row[f"server_{part}_mean"] = v
    return row


def _jsonable(x: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def write_results(result: BenchResult, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    with open(out_dir / "records.jsonl", "w") as f:
        for r in result.records:
            f.write(json.dumps(_jsonable(r.to_json())) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(_jsonable(result.summary_json()), indent=2) + "\n")
    write_csv(result.groups, out_dir / "summary.csv")
    (out_dir / "report.md").write_text(markdown_report(result))
    write_plots(result.groups, result.records, out_dir / "plots")
    result.out_dir = out_dir
    return out_dir


def write_csv(groups: list[dict[str, Any]], path: Path) -> None:
    rows = [flatten_group(g) for g in groups]
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if _jsonable(v) is None else v) for k, v in row.items()})


def fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


# (header, getter, digits): the figures shown in the terminal and the Markdown tables.
COLUMNS: list[tuple[str, Any, int]] = [
    ("group", lambda g: g["name"], 0),
    ("ok/err", lambda g: f"{g['completed']}/{g['errors']}", 0),
    ("E2E P50 s", lambda g: g["e2e_s"]["p50"], 3),
    ("E2E P99 s", lambda g: g["e2e_s"]["p99"], 3),
    ("E2E min s", lambda g: g["e2e_s"]["min"], 3),
    ("E2E TM95 s", lambda g: g["e2e_s"]["tm95"], 3),
    ("TTFT P50 ms", lambda g: g["ttft_ms"]["p50"], 1),
    ("TTFT P99 ms", lambda g: g["ttft_ms"]["p99"], 1),
    ("TPOT P50 ms", lambda g: g["tpot_ms"]["p50"], 2),
    ("ITL P99 ms", lambda g: g["itl_ms"]["p99"], 2),
    ("decode tok/s", lambda g: g["decode_tok_s"]["p50"], 1),
    ("out tok/s", lambda g: g["output_throughput"], 1),
    ("req/s", lambda g: g["request_throughput"], 3),
]


def _goodput_col(groups: list[dict[str, Any]]) -> list[tuple[str, Any, int]]:
    if any(g.get("request_goodput") is not None for g in groups):
        return [("goodput req/s", lambda g: g.get("request_goodput"), 3)]
    return []


def table_rows(groups: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    cols = COLUMNS + _goodput_col(groups)
    return [c[0] for c in cols], [[fmt(get(g), d) for _, get, d in cols] for g in groups]


def render_table(result: BenchResult):
    from rich.table import Table

    m = result.manifest
    t = Table(title=f"leverlab bench: {m['server']['model']} @ {m['server']['base_url']}", show_lines=False)
    headers, rows = table_rows(result.groups)
    for i, h in enumerate(headers):
        # "E2E P50 s" -> "E2E\nP50 s": two header lines keep the table within ~120 columns
        head = h if i == 0 else h.replace(" ", "\n", 1)
        t.add_column(head, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        t.add_row(*row)
    return t


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown_report(result: BenchResult) -> str:
    m = result.manifest
    srv = m["server"]
    out = [
        f"# leverlab bench: {srv['model']}\n",
        f"- server: `{srv['base_url']}` ({srv['endpoint']} endpoint)",
        f"- started {m['started']}, finished {m['finished']}",
        f"- git: {m['git'].get('revision')}{' (dirty)' if m['git'].get('dirty') else ''}",
        f"- machine: {m['machine'].get('platform')}, {m['machine'].get('cpu_count')} CPUs"
        + (f", GPUs: {'; '.join(m['machine']['gpus'])}" if m["machine"].get("gpus") else ""),
        f"- workload: {m['workload'].get('kind')} {m['workload'].get('path', '')}, seed {m['seed']}",
        f"- server lever settings (/version): `{json.dumps(srv.get('version'))}`"
        if srv.get("version")
        else "- server lever settings: not reported (no /version)",
        "",
    ]
    for kind, title in (
        ("single", "Single-request latency (concurrency 1)"),
        ("sweep", "Concurrency sweep"),
        ("poisson", "Poisson request rate"),
    ):
        gs = [g for g in result.groups if g["kind"] == kind]
        if gs:
            out.append(f"## {title}\n")
            out.append(_md_table(*table_rows(gs)))
    split_rows = []
    for g in result.groups:
        s = g.get("server_timings_ms")
        if s:
            parts = s["mean_ms"]
            split_rows.append(
                [g["name"], str(s["requests_reporting"])]
                + [
                    f"{fmt(parts.get(p), 1)} ({fmt(100 * s['share'].get(p, math.nan), 0)}%)"
                    for p in ("tokenize_ms", "queue_ms", "prefill_ms", "decode_ms", "detokenize_ms")
                ]
            )
    out.append("## Where the time went (server-reported, mean ms and share)\n")
    if split_rows:
        out.append(
            _md_table(["group", "n", "tokenize", "queue", "prefill", "decode", "detokenize"], split_rows)
        )
    else:
        out.append("The server reported no per-request timings.\n")
    cached = [
        (g["name"], g["cached_prompt_tokens"], g["cached_prompt_fraction"])
        for g in result.groups
        if g.get("cached_prompt_tokens") is not None
    ]
    if cached and any(c[1] for c in cached):
        out.append("## Prefix-cache hits (usage.prompt_tokens_details.cached_tokens)\n")
        out.append(
            _md_table(
                ["group", "cached prompt tokens", "share of prompt tokens"],
                [[n, str(t), fmt(f, 3)] for n, t, f in cached],
            )
        )
    out.append("## Server counters (Prometheus deltas over the run)\n")
    hl = (result.prometheus or {}).get("highlights")
    if result.prometheus is None:
        out.append("The server exposes no Prometheus /metrics.\n")
    elif hl:
        out.append("```json\n" + json.dumps(_jsonable(hl), indent=2) + "\n```\n")
    else:
        out.append("No prefix-cache, speculative-decoding or mixture-of-experts counters moved.\n")
    errs = [(g["name"], e) for g in result.groups for e in g.get("error_samples", [])]
    if errs:
        out.append("## Errors\n")
        out += [f"- {name}: `{e}`" for name, e in errs]
        out.append("")
    out.append("## Plots\n")
    out += [f"![{p}](plots/{p})" for p in PLOT_FILES]
    out.append(
        "\nDefinitions (as `vllm bench serve`): TTFT = send to first token-bearing chunk; ITL = gaps between "
        "token-bearing chunks; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = send to last token-bearing "
        "chunk; TM95 = mean of the fastest ceil(0.95 n) requests. See docs/bench.md.\n"
    )
    return "\n".join(out)


def _load_axis(groups: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str]:
    sweep = [g for g in groups if g["kind"] == "sweep"]
    if sweep:
        return "concurrency", sorted(sweep, key=lambda g: g["concurrency"]), "concurrency"
    pois = [g for g in groups if g["kind"] == "poisson"]
    if pois:
        return "request_rate", sorted(pois, key=lambda g: g["request_rate"]), "request rate (req/s)"
    return "concurrency", [g for g in groups if g["kind"] == "single"][:1], "concurrency"


def write_plots(groups: list[dict[str, Any]], records: list[RequestRecord], plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    key, gs, label = _load_axis(groups)
    xs = [g.get(key) or 1 for g in gs]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for stat in ("p50", "p90", "p99"):
        ax.plot(xs, [g["e2e_s"][stat] for g in gs], marker="o", label=f"E2E {stat.upper()}")
    ax2 = ax.twinx()
    ax2.plot(
        xs, [g["ttft_ms"]["p50"] for g in gs], marker="s", linestyle="--", color="gray", label="TTFT P50"
    )
    ax.set(
        xlabel=label,
        ylabel="end-to-end latency (s)",
        title=f"Latency vs load ({gs[0]['bucket'] if gs else ''})",
    )
    ax2.set_ylabel("TTFT (ms)")
    _load_ticks(ax, key, xs)
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    paths.append(_save(fig, plot_dir / PLOT_FILES[0]))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [g["output_throughput"] for g in gs], marker="o", label="output tok/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [g["request_throughput"] for g in gs], marker="s", color="tab:orange", label="req/s")
    ax.set(xlabel=label, ylabel="output tokens/s", title="Throughput vs load")
    ax2.set_ylabel("requests/s")
    _load_ticks(ax, key, xs)
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    paths.append(_save(fig, plot_dir / PLOT_FILES[1]))

    measured = [r for r in records if r.ok and r.group != "warmup"]
    by_group: dict[str, list[RequestRecord]] = {}
    for r in measured:
        by_group.setdefault(r.group, []).append(r)
    for fname, getter, xlabel in (
        (PLOT_FILES[2], lambda rs: [r.ttft_s * 1000 for r in rs], "TTFT (ms)"),
        (PLOT_FILES[3], lambda rs: [x * 1000 for r in rs for x in r.itl_s], "ITL (ms)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rs in by_group.items():
            vals = sorted(getter(rs))
            if vals:
                ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post", label=name)
        ax.set(
            xlabel=xlabel, ylabel="fraction of samples <= x", title=f"{xlabel.split()[0]} distribution (CDF)"
        )
        if by_group:
            ax.legend(fontsize="x-small")
        paths.append(_save(fig, plot_dir / fname))
    return paths


def _load_ticks(ax, key: str, xs: list[float]) -> None:
    """Concurrency levels double (1, 2, 4, ...): a log2 axis spaces them evenly, ticked at the levels run."""
    if key == "concurrency" and len(xs) > 1 and min(xs) > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
