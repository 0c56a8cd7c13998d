"""metrics.py: exact figures on hand-made records; percentiles identical to numpy's default."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leverlab.bench import metrics
from leverlab.bench.records import RequestRecord
from leverlab.bench.strategies import poisson_offsets


def rec(
    i: int,
    ttft: float,
    e2e: float,
    out: int,
    itl: list[float] | None = None,
    ok: bool = True,
    timings: dict | None = None,
) -> RequestRecord:
    return RequestRecord(
        id=f"r{i}",
        group="g",
        bucket="b",
        output_len=out,
        ok=ok,
        ttft_s=ttft if ok else None,
        e2e_s=e2e if ok else 0.0,
        itl_s=itl or [],
        output_tokens=out if ok else None,
        prompt_tokens=10 if ok else None,
        server_timings=timings,
        error=None if ok else "boom",
    )


def test_percentile_linear_interpolation_exact():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert metrics.percentile(xs, 50) == 2.5
    assert metrics.percentile(xs, 90) == pytest.approx(3.7)
    assert metrics.percentile(xs, 99) == pytest.approx(3.97)
    assert metrics.percentile(xs, 0) == 1.0
    assert metrics.percentile(xs, 100) == 4.0
    assert metrics.percentile([5.0], 99) == 5.0
    assert math.isnan(metrics.percentile([], 50))
    assert metrics.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # order does not matter


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60), st.floats(0, 100))
def test_percentile_matches_numpy(xs, p):
    assert metrics.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-9, abs=1e-6)


def test_tm95_drops_floor_five_percent():
    # n < 20: nothing dropped, TM95 == mean.
    xs19 = [float(i) for i in range(1, 20)]
    assert metrics.trimmed_mean(xs19) == pytest.approx(10.0)
    # n = 20: the single slowest (100) dropped.
    xs20 = [float(i) for i in range(1, 20)] + [100.0]
    assert metrics.trimmed_mean(xs20) == pytest.approx(10.0)
    # n = 40: the two slowest dropped, whatever the order.
    xs40 = [1.0] * 38 + [500.0, 900.0]
    assert metrics.trimmed_mean(list(reversed(xs40))) == 1.0
    # n = 100: exactly five dropped.
    xs100 = list(range(100))
    assert metrics.trimmed_mean([float(x) for x in xs100]) == pytest.approx(sum(range(95)) / 95)
    assert math.isnan(metrics.trimmed_mean([]))


def test_stats_fields():
    s = metrics.stats([3.0, 1.0, 2.0, 4.0])
    assert (s.n, s.mean, s.min, s.max, s.p50) == (4, 2.5, 1.0, 4.0, 2.5)
    assert s.std == pytest.approx(float(np.std([1, 2, 3, 4])))
    assert s.tm95 == 2.5
    empty = metrics.stats([])
    assert empty.n == 0 and math.isnan(empty.mean) and math.isnan(empty.p99)


def test_tpot_as_vllm():
    r = rec(0, ttft=0.1, e2e=1.1, out=11)
    assert metrics.tpot_s(r) == pytest.approx(0.1)  # (1.1 - 0.1) / (11 - 1)
    assert metrics.tpot_s(rec(1, 0.1, 0.1, out=1)) is None
    assert metrics.tpot_s(rec(2, 0.1, 0.1, out=5, ok=False)) is None


def test_aggregate_exact():
    recs = [
        rec(
            0,
            0.100,
            1.100,
            11,
            itl=[0.1] * 10,
            timings={"queue_ms": 10.0, "prefill_ms": 90.0, "decode_ms": 900.0},
        ),
        rec(
            1,
            0.200,
            2.200,
            11,
            itl=[0.2] * 10,
            timings={"queue_ms": 30.0, "prefill_ms": 170.0, "decode_ms": 1800.0},
        ),
        rec(2, 0.0, 0.0, 11, ok=False),
    ]
    g = metrics.aggregate(recs, duration_s=4.0, slo_ttft_ms=150, slo_tpot_ms=500)
    assert (g["requests"], g["completed"], g["errors"]) == (3, 2, 1)
    assert g["total_output_tokens"] == 22 and g["total_input_tokens"] == 20
    assert g["output_throughput"] == pytest.approx(22 / 4.0)
    assert g["request_throughput"] == pytest.approx(0.5)
    assert g["total_token_throughput"] == pytest.approx(42 / 4.0)
    assert g["good_requests"] == 1 and g["request_goodput"] == pytest.approx(0.25)
    assert g["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert g["ttft_ms"]["p90"] == pytest.approx(190.0)
    assert g["tpot_ms"]["p50"] == pytest.approx(150.0)  # tpots 100 and 200 ms
    assert g["itl_ms"]["n"] == 20 and g["itl_ms"]["mean"] == pytest.approx(150.0)
    assert g["e2e_s"]["max"] == pytest.approx(2.2) and g["e2e_ms"]["min"] == pytest.approx(1100.0)
    assert g["decode_tok_s"]["p50"] == pytest.approx(7.5)  # per request 10 and 5 tok/s
    assert g["output_len_mismatches"] == 0
    assert g["error_samples"] == ["boom"]
    split = g["server_timings_ms"]
    assert split["requests_reporting"] == 2
    assert split["mean_ms"] == {"queue_ms": 20.0, "prefill_ms": 130.0, "decode_ms": 1350.0}
    assert split["share"]["decode_ms"] == pytest.approx(1350.0 / 1500.0)


def test_goodput_absent_without_slo_and_tpot_slo_alone():
    recs = [rec(0, 0.1, 1.1, 11), rec(1, 0.1, 3.1, 11)]  # TPOT 100 ms and 300 ms
    assert metrics.aggregate(recs, 1.0)["request_goodput"] is None
    assert metrics.aggregate(recs, 2.0, slo_tpot_ms=200)["good_requests"] == 1
    assert metrics.aggregate(recs, 2.0, slo_e2e_ms=2000)["good_requests"] == 1


def test_length_mismatch_counted():
    r = rec(0, 0.1, 1.0, 11)
    r.output_tokens = 9
    assert metrics.aggregate([r], 1.0)["output_len_mismatches"] == 1


def test_poisson_offsets_seeded_and_rescaled():
    a = poisson_offsets(50, rate=5.0, seed=3)
    assert a == poisson_offsets(50, rate=5.0, seed=3)
    assert a != poisson_offsets(50, rate=5.0, seed=4)
    assert a[0] == 0.0 and a[-1] == pytest.approx(50 / 5.0)
    assert all(x <= y for x, y in zip(a, a[1:]))


def test_payload_holds_length_like_vllm():
    from leverlab.bench.client import build_payload
    from leverlab.bench.records import BenchRequest

    req = BenchRequest(id="x", bucket="b", output_len=7, prompt="hi")
    p = build_payload(req, model="m", endpoint="completions", temperature=0.0, ignore_eos=True)
    assert p["max_tokens"] == 7 and p["ignore_eos"] is True and "min_tokens" not in p
    assert p["stream"] and p["stream_options"] == {"include_usage": True} and p["prompt"] == "hi"
    p = build_payload(
        req,
        model="m",
        endpoint="chat",
        temperature=0.0,
        ignore_eos=False,
        min_tokens=True,
        extra_body={"top_k": 1},
    )
    assert p["messages"] == [{"role": "user", "content": "hi"}] and p["min_tokens"] == 7 and p["top_k"] == 1
    assert "ignore_eos" not in p


def test_a_coalesced_stream_has_no_decode_rate():
    """All of a request's tokens in one or two chunks (a server holding its stream back): its 1 / TPOT would read
    the hand-off, so it is counted apart and left out of decode_tok_s; TPOT keeps vllm's definition."""
    spread = rec(0, ttft=0.1, e2e=1.1, out=11, itl=[0.1] * 10)
    held = rec(1, ttft=0.65, e2e=0.651, out=129, itl=[0.001])  # 128 tokens 1 ms after the first
    agg = metrics.aggregate([spread, held], duration_s=1.0)
    assert agg["coalesced_streams"] == 1
    assert agg["decode_tok_s"]["n"] == 1 and agg["decode_tok_s"]["p50"] == pytest.approx(10.0)
    assert agg["tpot_ms"]["n"] == 2
    assert not metrics.coalesced(rec(2, ttft=0.1, e2e=0.2, out=3, itl=[0.1]))  # short outputs say nothing


def test_moe_weight_bytes_per_pass_from_a_scrape():
    """The harness derives a mixture-of-experts server's weight bytes per decode pass from its counters' deltas."""
    from leverlab.bench import prometheus

    text = (
        "# TYPE leverlab_engine_moe_decode_passes counter\nleverlab_engine_moe_decode_passes_total 10.0\n"
        "# TYPE leverlab_engine_moe_decode_passes_uncounted counter\n"
        "leverlab_engine_moe_decode_passes_uncounted_total 0.0\n"
        "# TYPE leverlab_engine_moe_weight_bytes_read counter\nleverlab_engine_moe_weight_bytes_read_total 5000.0\n"
    )
    before = prometheus.parse(text)
    after = prometheus.parse(text.replace(" 10.0", " 14.0").replace(" 5000.0", " 7000.0"))
    h = prometheus.highlights(prometheus.deltas(before, after))
    assert h["moe_weight_bytes_per_pass"] == 500.0
    assert set(h["moe"]) == {"leverlab_engine_moe_decode_passes_total", "leverlab_engine_moe_weight_bytes_read_total"}
    assert prometheus.moe_bytes_per_pass({"leverlab_engine_steps_total": 3.0}) is None
