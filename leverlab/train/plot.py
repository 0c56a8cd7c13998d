"""Training curves from a run's log.jsonl, drawn with matplotlib (Agg: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def read_log(run_dir: Path) -> list[dict]:
    path = run_dir / "log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curve(run_dir: Path, out_png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(run_dir)
    train = [r for r in recs if r.get("event") == "train"]
    val = [r for r in recs if r.get("event") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(
        [r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.7, label="train loss"
    )
    ax.plot(
        [r["tokens"] / 1e6 for r in val], [r["val_loss"] for r in val], "o-", ms=3, label="validation loss"
    )
    if train and "top1_agree" in train[0]:
        ax2 = ax.twinx()
        ax2.plot(
            [r["tokens"] / 1e6 for r in train],
            [r["top1_agree"] for r in train],
            color="tab:green",
            lw=0.6,
            alpha=0.6,
            label="top-1 agreement (train batches)",
        )
        ax2.set_ylabel("top-1 agreement with target")
        ax2.set_ylim(0, 1)
        ax2.legend(loc="upper center", fontsize=8)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel(
        "cross-entropy (nats)" if not (train and "kl" in train[0]) else "loss (distillation / val CE)"
    )
    if val:
        ax.set_ylim(top=max(2.0, min(8.0, max(r["val_loss"] for r in val[:1]) + 0.5)), bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
