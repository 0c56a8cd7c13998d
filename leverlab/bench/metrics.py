"""Pure functions over per-request records: percentiles, TM95, aggregates per group, goodput.

Definitions follow `vllm bench serve` (vllm/benchmarks/serve.py `calculate_metrics`) so figures compare
across tools; docs/bench.md states them. Nothing here touches the network or the clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from leverlab.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
# Server-reported per-request timings we know how to split (ms); see client.py for the sources.
TIMING_PARTS = ("tokenize_ms", "queue_ms", "prefill_ms", "decode_ms", "detokenize_ms")


def percentile(values: Sequence[float], p: float) -> float:
    """numpy.percentile's default ("linear"): rank = p/100 * (n - 1), interpolated between neighbours."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def trimmed_mean(values: Sequence[float], drop_fraction: float = 0.05) -> float:
    """TM95 for drop_fraction=0.05: the mean of the fastest ceil(0.95 * n) values.

    Exactly floor(drop_fraction * n) of the largest values are dropped, so with fewer than 20 values
    nothing is dropped and TM95 equals the mean; with 20..39 values the single slowest is dropped.
    """
    if not values:
        return math.nan
    xs = sorted(values)
    drop = math.floor(drop_fraction * len(xs) + 1e-9)
    kept = xs[: len(xs) - drop]
    return sum(kept) / len(kept)


@dataclass(frozen=True, slots=True)
class Stats:
    n: int
    mean: float
    std: float
    min: float
    max: float
    p50: float
    p90: float
    p95: float
    p99: float
    tm95: float

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


def stats(values: Iterable[float]) -> Stats:
    """Summary of a sample; NaN everywhere (n=0) for an empty one, never an exception."""
    xs = list(values)
    n = len(xs)
    if n == 0:
        nan = math.nan
        return Stats(0, nan, nan, nan, nan, nan, nan, nan, nan, nan)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)  # population std, as numpy.std
    return Stats(
        n=n,
        mean=mean,
        std=std,
        min=min(xs),
        max=max(xs),
        p50=percentile(xs, 50),
        p90=percentile(xs, 90),
        p95=percentile(xs, 95),
        p99=percentile(xs, 99),
        tm95=trimmed_mean(xs),
    )


def tpot_s(rec: RequestRecord) -> float | None:
    """(e2e - TTFT) / (output_tokens - 1), as vllm; None when fewer than two output tokens."""
    if not rec.ok or rec.output_tokens is None or rec.output_tokens <= 1 or rec.ttft_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


def coalesced(rec: RequestRecord) -> bool:
    """Whether the stream carried its output in at most two token-bearing chunks: the server held its tokens back
    and sent them at once (seen from vLLM on 2 busy cores, its front end starved of CPU: 128 tokens 1 ms apart
    after a 650 ms TTFT), so e2e - TTFT measures that hand-off, not decoding, and 1 / TPOT read 80,000 tok/s."""
    return rec.output_tokens is not None and rec.output_tokens >= 8 and len(rec.itl_s) + 1 <= 2


def is_good(
    rec: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None, slo_e2e_ms: float | None = None
) -> bool:
    """A request meets the SLOs when each given metric is <= its bound (vllm: `slo >= metric`).

    As in vllm, a request with fewer than two output tokens has TPOT 0 for this test.
    """
    if not rec.ok:
        return False
    if slo_ttft_ms is not None and rec.ttft_s * 1000 > slo_ttft_ms:
        return False
    if slo_tpot_ms is not None and (tpot_s(rec) or 0.0) * 1000 > slo_tpot_ms:
        return False
    return not (slo_e2e_ms is not None and rec.e2e_s * 1000 > slo_e2e_ms)


def _ms(xs: Iterable[float]) -> list[float]:
    return [x * 1000 for x in xs]


def aggregate(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
) -> dict:
    """All figures for one group of requests (one bucket at one concurrency or rate).

    duration_s is the group's wall time, first send to last completion (vllm's benchmark duration).
    Latencies are in ms except e2e, which is also given in s (the reference study's unit).
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = [r.output_tokens or 0 for r in ok]
    in_tokens = [r.prompt_tokens or 0 for r in ok]
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl_s]
    # Per-request decode speed: tokens after the first over the time after the first (= 1 / TPOT), from streams
    # that delivered their tokens as they were made (TPOT itself stays vllm's definition, over every request).
    streamed = [r for r in ok if not coalesced(r)]
    decode_rates = [1.0 / t for t in (tpot_s(r) for r in streamed) if t is not None and t > 0]
    total_out = sum(out_tokens)
    total_in = sum(in_tokens)
    dur = duration_s if duration_s > 0 else math.nan
    slo_given = any(v is not None for v in (slo_ttft_ms, slo_tpot_ms, slo_e2e_ms))
    good = sum(is_good(r, slo_ttft_ms, slo_tpot_ms, slo_e2e_ms) for r in ok) if slo_given else None
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    mismatched = [r.id for r in ok if r.exact_len and r.output_tokens is not None and r.output_tokens != r.output_len]

    agg = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": (good / dur) if good is not None else None,
        "good_requests": good,
        "output_len_mismatches": len(mismatched),
        "coalesced_streams": len(ok) - len(streamed),  # left out of decode_tok_s (coalesced())
        "ttft_ms": stats(_ms(r.ttft_s for r in ok)).as_dict(),
        "tpot_ms": stats(_ms(tpots)).as_dict(),
        "itl_ms": stats(_ms(itls)).as_dict(),
        "e2e_ms": stats(_ms(r.e2e_s for r in ok)).as_dict(),
        "e2e_s": stats(r.e2e_s for r in ok).as_dict(),
        "decode_tok_s": stats(decode_rates).as_dict(),
        "input_tokens": stats(in_tokens).as_dict(),
        "output_tokens": stats(out_tokens).as_dict(),
        "server_timings_ms": server_timing_split(ok),
        # Prefix-cache hits as the server reported them per request (usage.prompt_tokens_details).
        "cached_prompt_tokens": sum(cached) if cached else None,
        "cached_prompt_fraction": (sum(cached) / total_in) if cached and total_in else None,
    }
    if failed:
        agg["error_samples"] = sorted({(r.error or "")[:300] for r in failed})[:5]
    return agg


def server_timing_split(records: Sequence[RequestRecord]) -> dict | None:
    """Mean of each server-reported part (ms) and its share of the server total, over requests that
    reported timings; None when the server reported none (external servers)."""
    with_t = [r.server_timings for r in records if r.server_timings]
    if not with_t:
        return None
    # Only durations (*_ms) are averaged; servers also put counts in `timings` (ours: prompt_tokens).
    parts = sorted(
        {k for t in with_t for k in t if k.endswith("_ms") and isinstance(t.get(k), int | float)},
        key=lambda k: (TIMING_PARTS.index(k) if k in TIMING_PARTS else len(TIMING_PARTS), k),
    )
    means = {k: sum(t.get(k, 0.0) for t in with_t) / len(with_t) for k in parts}
    known_total = sum(means[k] for k in parts if k in TIMING_PARTS)
    return {
        "requests_reporting": len(with_t),
        "mean_ms": means,
        "share": {
            k: (means[k] / known_total if known_total else math.nan) for k in parts if k in TIMING_PARTS
        },
    }
