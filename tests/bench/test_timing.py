"""The harness against a stand-in server with known delays: every figure must come out as designed.

The stand-in schedules each chunk exactly and reports when its first and last chunks actually went out
(a loaded 2-core machine wakes sleeps late, sometimes by tens of ms). The expected figures are what the
server actually did; what is left is the client's own overhead, held to CLIENT_MS. That is well below what
a wrong definition would change: TTFT taken at the chat role chunk (-120 ms), E2E taken at the usage chunk
or [DONE] (+100 ms, the stand-in's tail), TPOT over chunks instead of tokens (30 vs 8 ms), TM95 without its
drop (+90 ms), a lost or extra ITL gap. The TPOT formula itself is checked exactly in test_metrics.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from leverlab.bench import BenchConfig, metrics, run_benchmark

CLIENT_MS = (
    30.0  # client-side overhead allowed per measurement (send -> server arrival, write -> read); a few
)
# ms normally, 15-40 ms with every core oversubscribed
SCHEDULE_MS = 80.0  # sanity bound on the stand-in's own lateness (it did follow its directive)


def cfg(base_url, wl, **kw) -> BenchConfig:
    base = dict(base_url=base_url, workload_file=str(wl), warmup=0, concurrency=[])
    base.update(kw)
    return BenchConfig(**base)


def actual(rec) -> tuple[float, float]:
    """(first, last) chunk send times in ms from the server's arrival, as the stand-in reported them."""
    return rec.server_timings["first_sent_ms"], rec.server_timings["last_sent_ms"]


def test_single_request_ttft_itl_tpot_e2e(fake_server, make_workload):
    ttfts = [60, 80, 100, 120, 140]
    texts = [f"[ttft={t} itl=15 tail=100] prompt {i}" for i, t in enumerate(ttfts)]
    wl = make_workload({"a": (6, texts)})
    res = run_benchmark(cfg(fake_server, wl, warmup=1))
    recs = {r.id: r for r in res.records if r.group == "single/a"}
    assert len(recs) == 5
    assert [r.group for r in res.records].count("warmup") == 1
    got_ttft, got_e2e = [], []
    for i, t in enumerate(ttfts):
        r = recs[f"a-{i:03d}"]
        first, last = actual(r)
        assert first == pytest.approx(t, abs=SCHEDULE_MS) and last == pytest.approx(t + 75, abs=SCHEDULE_MS)
        assert r.ok and r.output_tokens == 6 and r.output_tokens_source == "usage"
        assert r.ttft_s * 1000 == pytest.approx(first, abs=CLIENT_MS)
        assert r.e2e_s * 1000 == pytest.approx(last, abs=CLIENT_MS)  # not the usage chunk, 100 ms later
        assert len(r.itl_s) == 5  # one gap per chunk after the first
        assert sum(r.itl_s) * 1000 == pytest.approx(last - first, abs=CLIENT_MS)
        assert metrics.tpot_s(r) * 1000 == pytest.approx((last - first) / 5, abs=CLIENT_MS / 5)
        assert r.server_timings["prefill_ms"] == t - 3.0
        got_ttft.append(first)
        got_e2e.append(last)
    g = res.group("single/a")
    assert g["completed"] == 5 and g["errors"] == 0 and g["output_len_mismatches"] == 0
    for s in ("p50", "p90", "p95", "p99", "min", "max", "mean", "tm95"):
        assert g["e2e_ms"][s] == pytest.approx(getattr(metrics.stats(got_e2e), s), abs=CLIENT_MS), s
        assert g["ttft_ms"][s] == pytest.approx(getattr(metrics.stats(got_ttft), s), abs=CLIENT_MS), s
    assert g["ttft_ms"]["p90"] == pytest.approx(np.percentile(got_ttft, 90), abs=CLIENT_MS)
    assert g["itl_ms"]["n"] == 25
    assert g["server_timings_ms"]["mean_ms"]["queue_ms"] == 2.0
    # The server's counters moved by exactly what the phase sent: 4 hits per 10 queries per request.
    hl = g["prometheus"]["highlights"]
    assert hl["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert g["prometheus"]["deltas"]["fake_requests_total"] == 5
    assert g["prometheus"]["deltas"]["fake_e2e_seconds_count"] == 5
    assert "fake_running" not in g["prometheus"]["deltas"]  # gauges are not diffed
    assert res.manifest["server"]["model"] == "fake-model"
    assert res.manifest["server"]["version"]["levers"] == {"quantization": None, "speculative": None}


def test_tm95_and_percentiles_over_twenty(fake_server, make_workload):
    # 20 requests, E2E = 50 + 10 i + 30 ms, 4 in flight (the server's delays do not depend on load; more in
    # flight would measure this 2-core machine's client overhead instead). Warm-up opens the connections.
    ttfts = [50 + 10 * i for i in range(20)]
    ttfts[7] = 2000  # one slow outlier: TM95 must drop exactly it
    wl = make_workload({"a": (4, [f"[ttft={t} itl=10] p{i}" for i, t in enumerate(ttfts)])})
    res = run_benchmark(cfg(fake_server, wl, single=False, concurrency=[4], sweep_bucket="a", warmup=4))
    g = res.group("sweep/a/c4")
    assert g["completed"] == 20
    e2e = [actual(r)[1] for r in res.records if r.group == "sweep/a/c4"]
    want = metrics.stats(e2e)
    assert want.tm95 == pytest.approx(np.mean(sorted(e2e)[:19]))
    assert want.tm95 < want.mean - 2 * CLIENT_MS  # the outlier matters, so the check can fail
    for s in ("p50", "p90", "p95", "p99", "tm95", "max"):
        assert g["e2e_ms"][s] == pytest.approx(getattr(want, s), abs=CLIENT_MS), s


def test_packed_chunks_count_tokens_not_chunks(fake_server, make_workload):
    # 12 tokens in chunks of 3: 4 chunks, 3 ITL gaps of ~30 ms; TPOT = (last - first) / 11 tokens, not / 3.
    wl = make_workload({"a": (12, ["[ttft=50 itl=30 pack=3] p"])})
    res = run_benchmark(cfg(fake_server, wl))
    (r,) = [r for r in res.records if r.group == "single/a"]
    first, last = actual(r)
    assert r.output_tokens == 12 and len(r.itl_s) == 3 and r.chunk_tokens == [1, 1, 1, 1]
    assert metrics.tpot_s(r) * 1000 == pytest.approx((last - first) / 11, abs=3.0)  # / 3 chunks would be ~30
    assert r.e2e_s * 1000 == pytest.approx(last, abs=CLIENT_MS)


def test_chat_role_announcement_is_not_the_first_token(fake_server, make_workload):
    wl = make_workload({"a": (5, ["[ttft=120 itl=10] p"])})
    res = run_benchmark(cfg(fake_server, wl, endpoint="chat"))
    (r,) = [r for r in res.records if r.group == "single/a"]
    assert r.ok and r.ttft_s * 1000 == pytest.approx(actual(r)[0], abs=CLIENT_MS)
    assert actual(r)[0] >= 120 and len(r.itl_s) == 4
    # the file's chat conversations as a bucket
    res = run_benchmark(cfg(fake_server, wl, endpoint="chat", buckets=["chat"], output_len=3))
    (r,) = [r for r in res.records if r.group == "single/chat"]
    assert r.ok and r.output_tokens == 3 and r.ttft_s * 1000 == pytest.approx(actual(r)[0], abs=CLIENT_MS)


def test_errors_are_counted_not_raised(fake_server, make_workload):
    wl = make_workload({"a": (3, ["[ttft=20 itl=5] ok", "[fail=500] bad", "[fail=400] bad2"])})
    res = run_benchmark(cfg(fake_server, wl))
    g = res.group("single/a")
    assert (g["requests"], g["completed"], g["errors"]) == (3, 1, 2)
    bad = [r for r in res.records if not r.ok]
    assert sorted(r.http_status for r in bad) == [400, 500]
    assert all("told to fail" in r.error for r in bad)


def test_unreachable_server_is_a_clean_error(make_workload):
    from leverlab.bench.runner import BenchError

    wl = make_workload({"a": (3, ["p"])})
    with pytest.raises(BenchError, match="could not list models"):
        run_benchmark(cfg("http://127.0.0.1:9/v1", wl, timeout_s=2))


def test_concurrency_sweep_throughput(fake_server, make_workload):
    # Each request takes 50 + 4 * 25 = 150 ms regardless of load: c requests in flight give c / 0.15 req/s.
    wl = make_workload({"a": (5, [f"[ttft=50 itl=25] p{i}" for i in range(4)])})
    res = run_benchmark(
        cfg(fake_server, wl, single=False, concurrency=[1, 4], sweep_bucket="a", sweep_rounds=2)
    )
    g1, g4 = res.group("sweep/a/c1"), res.group("sweep/a/c4")
    assert g1["requests"] == 4 and g4["requests"] == 8  # max(bucket size, rounds * c)
    assert g1["request_throughput"] == pytest.approx(1 / 0.150, rel=0.25)
    assert g4["request_throughput"] == pytest.approx(4 / 0.150, rel=0.3)
    assert g4["request_throughput"] > 2.5 * g1["request_throughput"]  # the batching effect is measured
    assert g4["output_throughput"] == pytest.approx(g4["request_throughput"] * 5, rel=1e-9)
    assert {r.concurrency for r in res.records if r.group == "sweep/a/c4"} == {4}


def test_sweep_at_concurrency_one_reuses_the_single_phase(fake_server, make_workload):
    wl = make_workload({"a": (5, [f"[ttft=20 itl=5] p{i}" for i in range(3)])})
    res = run_benchmark(cfg(fake_server, wl, concurrency=[1, 2], sweep_bucket="a", sweep_rounds=1))
    single, c1 = res.group("single/a"), res.group("sweep/a/c1")
    assert c1["same_requests_as"] == "single/a" and res.group("sweep/a/c2")["same_requests_as"] is None
    ids = {g: sorted(r.id for r in res.records if r.group == g) for g in ("single/a", "sweep/a/c1")}
    assert ids["single/a"] == ids["sweep/a/c1"] and len(ids["single/a"]) == 3
    same = [r for r in res.records if r.group == "sweep/a/c1"]
    assert all(r.concurrency == 1 for r in same)
    assert c1["ttft_ms"] == single["ttft_ms"] and c1["output_throughput"] == single["output_throughput"]


def test_poisson_mode_and_goodput(fake_server, make_workload):
    ttfts = [40, 80, 160, 240]
    wl = make_workload({"a": (3, [f"[ttft={t} itl=5] p{i}" for i, t in enumerate(ttfts)])})
    res = run_benchmark(
        cfg(
            fake_server,
            wl,
            single=False,
            request_rates=[20.0],
            sweep_bucket="a",
            num_prompts=8,
            slo_ttft_ms=120,
            seed=1,
        )
    )
    g = res.group("poisson/a/r20")
    assert g["requests"] == 8 and g["completed"] == 8
    starts = sorted(r.start_s for r in res.records if r.group == "poisson/a/r20")
    assert starts[-1] - starts[0] == pytest.approx(8 / 20.0, abs=0.05)  # rescaled arrivals
    # goodput counts exactly the requests whose measured TTFT met the SLO
    recs = [r for r in res.records if r.group == "poisson/a/r20"]
    assert g["good_requests"] == sum(r.ttft_s * 1000 <= 120 for r in recs)
    assert 2 <= g["good_requests"] <= 6  # ~4 designed to pass (40, 80 ms), 4 to fail (160, 240 ms)
    assert g["request_goodput"] == pytest.approx(g["good_requests"] / g["duration_s"])
