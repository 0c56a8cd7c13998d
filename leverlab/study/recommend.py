"""A plain-language recommendation for three goals, from the measured numbers.

  lowest latency          the smallest P50 end-to-end latency at concurrency 1 on the sweep bucket
  highest throughput      the most requests/s at the highest concurrency measured
  lowest cost per token   the fewest device-seconds per 1,000 output tokens at the highest concurrency
                          (devices = tensor-parallel size: a TP=2 configuration pays for two); with
                          --price-per-hour, dollars per million output tokens at that throughput
Configurations flagged as bugs (speculation that changed greedy tokens) are never recommended. Each pick
states what it costs in fidelity; when it changes outputs, the best configuration that keeps every greedy
output identical to the baseline is named as the faithful alternative.
"""

from __future__ import annotations

from typing import Any


def _ok(c: dict[str, Any]) -> bool:
    return c["status"] == "done" and not c.get("bug") and bool(c.get("metrics"))


def _identical(c: dict[str, Any]) -> bool | None:
    agr = (c.get("fidelity") or {}).get("agreement")
    return None if agr is None else agr["share_identical"] == 1.0


def fidelity_phrase(c: dict[str, Any], baseline: str) -> str:
    if c["name"] == baseline:
        return "it is the baseline"
    f = c.get("fidelity") or {}
    agr = f.get("agreement")
    if agr is None:
        return "its fidelity was not measured"
    kl = (f.get("kl") or {}).get("mean")
    kl_txt = f", KL {kl:.4f} nats/token" if isinstance(kl, float) and kl == kl else ""
    if agr["share_identical"] == 1.0:
        return f"it says exactly what the baseline says ({agr['identical']}/{agr['n']} greedy outputs identical{kl_txt})"
    return (
        f"it changes what the model says: {agr['identical']}/{agr['n']} greedy outputs identical, the first "
        f"difference at token {agr['mean_first_divergence']:.0f} on average{kl_txt}"
    )


def devices(c: dict[str, Any]) -> int:
    """Devices a configuration pays for: one per process that is busy serving, tensor-parallel ranks times
    data-parallel replicas."""
    return c["levers"].tensor_parallel_size * c["levers"].data_parallel_size


def cost_per_1k_tokens(c: dict[str, Any]) -> float | None:
    tput = (c.get("metrics") or {}).get("out_tok_s_cmax")
    return devices(c) * 1000 / tput if tput else None


def usd_per_million_tokens(c: dict[str, Any], price_per_hour: float | None) -> float | None:
    """Dollars per million output tokens at the configuration's measured output rate at the top concurrency:
    devices x $/hour / 3600 = $/s, over tokens/s, x 1e6."""
    tput = (c.get("metrics") or {}).get("out_tok_s_cmax")
    if not tput or price_per_hour is None:
        return None
    return devices(c) * price_per_hour / 3600 / tput * 1e6


def goals(price_per_hour: float | None) -> tuple:
    if price_per_hour is None:
        return GOALS
    dollars = (
        "lowest cost per token",
        lambda c: usd_per_million_tokens(c, price_per_hour),
        min,
        "${v:.2f} per million output tokens at concurrency {c_max} "
        + f"(${price_per_hour:g} per device-hour)",
    )
    return GOALS[:2] + (dollars,)


GOALS = (
    ("lowest latency", lambda c: c["metrics"].get("e2e_p50_s"), min, "P50 {v:.2f} s at concurrency 1"),
    (
        "highest throughput",
        lambda c: c["metrics"].get("rps_cmax"),
        max,
        "{v:.3f} requests/s at concurrency {c_max}",
    ),
    (
        "lowest cost per token",
        cost_per_1k_tokens,
        min,
        "{v:.1f} device-seconds per 1,000 output tokens at concurrency {c_max}",
    ),
)


def recommend(a: dict[str, Any]) -> list[dict[str, Any]]:
    configs = [c for c in a["configs"] if _ok(c)]
    baseline = a["configs"][0]
    out = []
    for goal, key, pick, fmt in goals(a.get("price_per_hour")):
        cands = [(key(c), c) for c in configs if key(c) is not None]
        if not cands:
            out.append({"goal": goal, "config": None, "text": f"No configuration measured for {goal}."})
            continue
        v, best = pick(cands, key=lambda t: t[0])
        text = f"**{best['name']}** ({best['change']}): " + fmt.format(
            v=v, c_max=best["metrics"].get("c_max")
        )
        bv = key(baseline) if _ok(baseline) else None
        if bv and best is not baseline:
            factor = (bv / v) if pick is min else (v / bv)
            text += f", {factor:.2f}x better than the baseline"
        text += f"; {fidelity_phrase(best, baseline['name'])}."
        faithful = None
        if _identical(best) is False:
            same = [(k, c) for k, c in cands if _identical(c) or c is baseline]
            if same:
                fv, faithful = pick(same, key=lambda t: t[0])
                text += (
                    f" If outputs must not change: **{faithful['name']}** ("
                    + fmt.format(v=fv, c_max=faithful["metrics"].get("c_max"))
                    + ")."
                )
        out.append(
            {
                "goal": goal,
                "config": best["name"],
                "value": v,
                "faithful": faithful and faithful["name"],
                "text": text,
            }
        )
    unavailable = [c["name"] for c in a["configs"] if c["status"] == "unavailable"]
    if unavailable:
        out.append(
            {
                "goal": "note",
                "config": None,
                "text": f"Not available on this engine, so not in the running: {', '.join(unavailable)}.",
            }
        )
    return out
