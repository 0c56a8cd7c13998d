"""The report's plots (matplotlib, Agg): latency against concurrency, the latency-throughput Pareto chart, and
the bandwidth model's predictions against the measurements. Files under plots/; the report embeds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leverlab.study.report.fmt import _m


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


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def write_engine_plots(analyses: dict[str, dict[str, Any]], plot_dir: Path) -> dict[str, Path]:
    """Engines on one machine, one chart each question: every engine's (configuration, concurrency) points on
    one latency-throughput chart, a colour and marker per engine and its own Pareto frontier in that colour
    (where each engine can go); and decode tok/s at concurrency 1 per configuration, a bar per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    for i, (eng, a) in enumerate(analyses.items()):
        col, mk = colours[i % len(colours)], MARKERS[i % len(MARKERS)]
        pts = []
        for c in a["configs"]:
            for k, v in (_m(c).get("sweep") or {}).items():
                x, y = v.get("output_throughput"), v.get("e2e_p50_s")
                if x is not None and y is not None:
                    pts.append((x, y, c["name"], k))
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=20, color=col, marker=mk, alpha=0.55)
        front = _pareto([(p[0], p[1]) for p in pts])
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color=col, marker=mk, lw=1.2,
                label=f"{eng} ({len(pts)} points; dashed: its Pareto frontier)")
        # One label per frontier point: configurations that measured the same point share it ("+2").
        at: dict[tuple, list[str]] = {}
        for x, y, name, k in pts:
            if (x, y) in front:
                at.setdefault((x, y), []).append(f"{name} c{k}")
        for (x, y), labels in at.items():
            text = labels[0] + (f" +{len(labels) - 1}" if len(labels) > 1 else "")
            ax.annotate(text, (x, y), fontsize=6, color=col, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("P50 end-to-end latency (s)")
    ax.set_title("Latency against throughput, every engine (lower right is better)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    paths["pareto"] = _save(fig, plot_dir / "engines_pareto.png")

    names: list[str] = []
    for a in analyses.values():
        names += [c["name"] for c in a["configs"] if c["name"] not in names]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.55 * len(names) * max(1, len(analyses)) / 2), 4.2))
    width = 0.8 / max(1, len(analyses))
    for i, (eng, a) in enumerate(analyses.items()):
        byn = {c["name"]: c for c in a["configs"]}
        ys = [_m(byn.get(n) or {}).get("decode_tok_s") or 0 for n in names]
        ax.bar([j + i * width for j in range(len(names))], ys, width, label=eng, color=colours[i % len(colours)])
    ax.set_xticks([j + width * (len(analyses) - 1) / 2 for j in range(len(names))], names, rotation=40,
                  ha="right", fontsize=7)
    ax.set_ylabel("decode tok/s (P50, concurrency 1)")
    ax.set_title("Single-stream decode per configuration (no bar: not measured)")
    ax.grid(alpha=0.3, axis="y")
    if analyses:
        ax.legend(fontsize=7)
    paths["decode"] = _save(fig, plot_dir / "engines_decode.png")
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
