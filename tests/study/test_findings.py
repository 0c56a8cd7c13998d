"""The findings logic and the recommendations on constructed analyses (no servers)."""

from __future__ import annotations

from leverlab.study import findings as F
from leverlab.study.plan import Levers
from leverlab.study.recommend import recommend

NG = {"method": "ngram", "num_speculative_tokens": 4}


def cfg(name, parent, lever, levers, status="done", **m):
    c = {
        "name": name,
        "parent": parent,
        "lever": lever,
        "levers": levers,
        "status": status,
        "change": lever or "baseline",
    }
    c["metrics"] = m if status == "done" else None
    c["reason"] = None if status == "done" else "not built yet"
    return c


def single(short, long_, decode, s_in=64, l_in=1500, out=256, d_out=1024):
    return {
        "short": {"e2e_p50_s": short, "input_tokens": s_in, "output_tokens": out},
        "long": {"e2e_p50_s": long_, "input_tokens": l_in, "output_tokens": out},
        "decode": {"e2e_p50_s": decode, "input_tokens": s_in, "output_tokens": d_out},
    }


def test_output_length_reproduced_with_the_reference_numbers():
    # the reference: 72 -> 1608 input tokens added ~0.35 s; 256 -> 1024 output ~4x
    a = {"configs": [cfg("base", None, None, Levers(), single=single(4.88, 5.23, 19.5))]}
    f = F.check_output_length(a)
    assert f["status"] == F.REPRODUCED and "per output token" in f["evidence"]


def test_output_length_not_reproduced_when_prefill_is_expensive():
    a = {"configs": [cfg("base", None, None, Levers(), single=single(1.0, 30.0, 4.0))]}
    f = F.check_output_length(a)
    assert f["status"] == F.NOT_REPRODUCED and "prefill is compute-bound" in f["why"]
    s = single(1.0, 3.0, 4.0)
    s["short"]["ttft_p50_ms"], s["long"]["ttft_p50_ms"] = 20.0, 1520.0
    f = F.check_output_length({"configs": [cfg("base", None, None, Levers(), single=s)]})
    assert (
        f["status"] == F.PARTLY and "1.50 s is prefill" in f["why"] and "0.50 s is slower decode" in f["why"]
    )


def test_output_length_not_tested_without_buckets():
    a = {"configs": [cfg("base", None, None, Levers(), single={})]}
    assert F.check_output_length(a)["status"] == F.NOT_TESTED


def _prec(dec8, dec4):
    pred = lambda b: {"bytes_per_pass": b}  # noqa: E731
    cs = [
        cfg("base", None, None, Levers(), decode_tok_s=100.0, rps_cmax=1.0, c_max=16),
        cfg(
            "int8",
            "base",
            "precision",
            Levers(quantization="int8"),
            decode_tok_s=dec8,
            rps_cmax=1.5,
            c_max=16,
        ),
        cfg(
            "int4",
            "int8",
            "precision",
            Levers(quantization="int4"),
            decode_tok_s=dec4,
            rps_cmax=2.0,
            c_max=16,
        ),
    ]
    for c, b in zip(cs, (2.0, 1.0, 0.5)):
        c["prediction"] = pred(b)
    cs[0]["prediction"].update(t_fixed_ms=5.0, t_bytes_ms=1.0)
    return {"configs": cs}


def test_precision_tracks_byte_ratio():
    f = F.check_precision(_prec(190.0, 370.0))  # 1.9x and 1.95x for 2x bytes
    assert f["status"] == F.REPRODUCED and "bytes/pass ratio 2.00x" in f["evidence"]


def test_precision_partly_when_fixed_costs_dominate():
    f = F.check_precision(_prec(115.0, 125.0))
    assert f["status"] == F.PARTLY and "fixed per-pass costs dominate" in f["why"]


def test_precision_not_reproduced_when_slower():
    assert F.check_precision(_prec(90.0, 95.0))["status"] == F.NOT_REPRODUCED


def _ngram(ng_decode, ng_rps, ad_decode, ad_rps, ad_status="done"):
    base = Levers(quantization="int8")
    return {
        "configs": [
            cfg("b", None, None, Levers(), decode_tok_s=1.0),
            cfg(
                "int8", "b", "precision", base, single={"decode": {"e2e_p50_s": 10.0}}, rps_cmax=2.0, c_max=16
            ),
            cfg(
                "ng",
                "int8",
                "speculation",
                Levers(quantization="int8", speculative=NG),
                single={"decode": {"e2e_p50_s": ng_decode}},
                rps_cmax=ng_rps,
                c_max=16,
            ),
            cfg(
                "ad",
                "ng",
                "speculation",
                Levers(quantization="int8", speculative={**NG, "adaptive": True}),
                ad_status,
                single={"decode": {"e2e_p50_s": ad_decode}},
                rps_cmax=ad_rps,
                c_max=16,
            ),
        ]
    }


def test_ngram_reproduced():
    f = F.check_ngram(_ngram(8.0, 1.6, 8.2, 2.0))
    assert f["status"] == F.REPRODUCED, f


def test_ngram_partly_when_adaptive_also_loses():
    f = F.check_ngram(_ngram(8.0, 1.6, 8.2, 1.6))
    assert f["status"] == F.PARTLY and "adaptive mode lost" in f["why"]


def test_ngram_not_reproduced_when_it_neither_helps_nor_hurts():
    f = F.check_ngram(_ngram(10.5, 2.1, 10.4, 2.0))
    assert f["status"] == F.NOT_REPRODUCED and "did not lower latency" in f["why"]


def test_ngram_not_tested_when_refused():
    a = _ngram(8.0, 1.6, 8.2, 2.0)
    a["configs"][2]["status"] = "unavailable"
    assert F.check_ngram(a)["status"] == F.NOT_TESTED


def test_exactness_flags_a_bug():
    a = _ngram(8.0, 1.6, 8.2, 2.0)
    a["configs"][2]["fidelity"] = {"exactness": {"exact": False, "identical": 3, "n": 4}}
    a["configs"][3]["fidelity"] = {"exactness": {"exact": True, "identical": 4, "n": 4}}
    f = F.check_exactness(a)
    assert f["status"] == F.NOT_REPRODUCED and "BUG" in f["why"] and "ng" in f["why"]


def test_tensor_parallel_not_tested_quotes_the_engine():
    a = {
        "configs": [
            cfg("b", None, None, Levers()),
            cfg("tp2", "b", "tensor_parallel", Levers(tensor_parallel_size=2), "unavailable"),
        ]
    }
    f = F.check_tensor_parallel(a)
    assert f["status"] == F.NOT_TESTED and "not built yet" in f["why"]


def _tp_dp(tp_lat, tp_tput, dp_lat, dp_tput):
    return {"configs": [
        cfg("b", None, None, Levers()),
        cfg("tp2", "b", "tensor_parallel", Levers(tensor_parallel_size=2), e2e_p50_s=tp_lat,
            out_tok_s_cmax=tp_tput, c_max=16),
        cfg("dp2", "b", "replicas", Levers(data_parallel_size=2), e2e_p50_s=dp_lat, out_tok_s_cmax=dp_tput,
            c_max=16),
    ]}


def test_replicas_vs_tp_names_the_winner_of_each():
    f = F.check_replicas_vs_tp(_tp_dp(1.0, 100.0, 2.0, 180.0))  # the reference's trade
    assert f["status"] == F.REPRODUCED
    assert "tp2 wins" in f["evidence"] and "dp2 wins" in f["evidence"] and "50.0 vs dp2 90.0" in f["evidence"]
    f = F.check_replicas_vs_tp(_tp_dp(3.0, 50.0, 1.0, 180.0))  # replicas win both (one shared CPU)
    assert f["status"] == F.PARTLY and "latency (P50, concurrency 1) tp2 3.00 s vs dp2 1.00 s: dp2 wins" in f["evidence"]
    f = F.check_replicas_vs_tp(_tp_dp(3.0, 200.0, 1.0, 100.0))
    assert f["status"] == F.NOT_REPRODUCED
    only_tp = {"configs": _tp_dp(1, 1, 1, 1)["configs"][:2]}
    assert F.check_replicas_vs_tp(only_tp)["status"] == F.NOT_TESTED


def test_multiply_compares_the_same_change_on_two_parents():
    sp = {"method": "eagle"}
    a = {
        "configs": [
            cfg("b", None, None, Levers(), decode_tok_s=100.0),
            cfg("int8", "b", "precision", Levers(quantization="int8"), decode_tok_s=150.0),
            cfg("int4", "int8", "precision", Levers(quantization="int4"), decode_tok_s=200.0),
            cfg("e", "int8", "speculation", Levers(quantization="int8", speculative=sp), decode_tok_s=300.0),
            cfg("champ", "e", "precision", Levers(quantization="int4", speculative=sp), decode_tok_s=390.0),
        ]
    }
    f = F.check_multiply(a)
    assert f["status"] == F.REPRODUCED and "1.33x on int8, 1.30x on e" in f["evidence"]


def test_check_all_never_raises():
    out = F.check_all({"configs": [cfg("b", None, None, Levers(), "failed")], "bandwidth_gbs": 10.0})
    assert len(out) == 12 and all(
        f["status"] in (F.REPRODUCED, F.PARTLY, F.NOT_REPRODUCED, F.NOT_TESTED) for f in out
    )


def test_recommendations_skip_bugs_and_name_a_faithful_alternative():
    base = cfg("b", None, None, Levers(), e2e_p50_s=2.0, rps_cmax=1.0, out_tok_s_cmax=100.0, c_max=16)
    fast = cfg(
        "int4",
        "b",
        "precision",
        Levers(quantization="int4"),
        e2e_p50_s=1.0,
        rps_cmax=2.0,
        out_tok_s_cmax=200.0,
        c_max=16,
    )
    fast["fidelity"] = {
        "agreement": {"share_identical": 0.5, "identical": 2, "n": 4, "mean_first_divergence": 30.0}
    }
    bug = cfg(
        "ng",
        "b",
        "speculation",
        Levers(speculative=NG),
        e2e_p50_s=0.5,
        rps_cmax=9.0,
        out_tok_s_cmax=900.0,
        c_max=16,
    )
    bug["bug"] = True
    same = cfg(
        "ng2",
        "b",
        "speculation",
        Levers(speculative={**NG, "adaptive": True}),
        e2e_p50_s=1.5,
        rps_cmax=1.1,
        out_tok_s_cmax=110.0,
        c_max=16,
    )
    same["fidelity"] = {
        "agreement": {"share_identical": 1.0, "identical": 4, "n": 4, "mean_first_divergence": 64.0}
    }
    refused = cfg("tp", "b", "tensor_parallel", Levers(tensor_parallel_size=2), "unavailable")
    recs = {r["goal"]: r for r in recommend({"configs": [base, fast, bug, same, refused]})}
    lat = recs["lowest latency"]
    assert lat["config"] == "int4" and lat["faithful"] == "ng2" and "2.00x better" in lat["text"]
    assert "changes what the model says" in lat["text"]
    assert recs["highest throughput"]["config"] == "int4"
    assert recs["lowest cost per token"]["value"] == 5.0  # 1000 / 200 device-seconds per 1k tokens
    assert "tp" in recs["note"]["text"]


def test_cost_in_dollars_per_million_tokens_with_a_price():
    """$/M tokens = devices x $/hour / 3600 / (output tokens/s) x 1e6; a TP=2 configuration pays for two."""
    from leverlab.study.recommend import usd_per_million_tokens

    base = cfg("b", None, None, Levers(), e2e_p50_s=2.0, rps_cmax=1.0, out_tok_s_cmax=100.0, c_max=16)
    tp2 = cfg("tp2", "b", "tensor_parallel", Levers(tensor_parallel_size=2), e2e_p50_s=1.0, rps_cmax=1.5,
              out_tok_s_cmax=150.0, c_max=16)
    assert usd_per_million_tokens(base, 3.6) == 10.0  # $0.001/s over 100 tok/s
    assert abs(usd_per_million_tokens(tp2, 3.6) - 2 * 0.001 / 150 * 1e6) < 1e-9
    assert usd_per_million_tokens(base, None) is None
    recs = {r["goal"]: r for r in recommend({"configs": [base, tp2], "price_per_hour": 3.6})}
    cost = recs["lowest cost per token"]
    assert cost["config"] == "b" and cost["value"] == 10.0
    assert "$10.00 per million output tokens" in cost["text"] and "$3.6 per device-hour" in cost["text"]
    # without a price: device-seconds, as before
    recs = {r["goal"]: r for r in recommend({"configs": [base, tp2]})}
    assert "device-seconds" in recs["lowest cost per token"]["text"]


def test_batching_finding_compares_static_with_continuous_at_the_top_concurrency():
    sweep = lambda p50: {16: {"e2e_p50_s": p50}}  # noqa: E731
    base = cfg("b", None, None, Levers(), rps_cmax=2.0, c_max=16, sweep=sweep(1.0))
    st = cfg("st", "b", "batching", Levers(batching="static"), rps_cmax=1.5, c_max=16, sweep=sweep(1.6))
    f = F.check_batching({"configs": [base, st]})
    assert f["status"] == F.REPRODUCED and "2.000 req/s" in f["evidence"] and "1.500 req/s" in f["evidence"]
    st["metrics"]["rps_cmax"] = 2.0
    assert F.check_batching({"configs": [base, st]})["status"] == F.PARTLY
    assert F.check_batching({"configs": [base]})["status"] == F.NOT_TESTED


def test_model_finding_reports_speed_and_fidelity():
    base = cfg("b", None, None, Levers(), decode_tok_s=100.0)
    small = cfg("small", "b", "model", Levers(model="models/leverlab-code-draft"), decode_tok_s=250.0)
    small["fidelity"] = {"agreement": {"share_identical": 0.25, "identical": 1, "n": 4}}
    f = F.check_model({"configs": [base, small]})
    assert f["status"] == F.REPRODUCED and "decode 2.50x" in f["evidence"] and "1/4 greedy" in f["evidence"]
    small["metrics"]["decode_tok_s"] = 99.0
    assert F.check_model({"configs": [base, small]})["status"] == F.NOT_REPRODUCED


def test_jump_forward_finding_reads_the_agent_workload():
    agent = lambda p50, p16: {"e2e_p50_s": p50, "c_max": 16, "sweep": {16: {"e2e_p50_s": p16}}}  # noqa: E731
    base = cfg("b", None, None, Levers(), agent=agent(0.05, 0.20))
    off = cfg("off", "b", "structured", Levers(structured_jump_forward=False), agent=agent(0.10, 0.24))
    f = F.check_jump_forward({"configs": [base, off]})
    assert f["status"] == F.REPRODUCED and "50 ms" in f["evidence"] and "2.00x" in f["evidence"]
    off["metrics"]["agent"] = agent(0.05, 0.2)
    assert F.check_jump_forward({"configs": [base, off]})["status"] == F.NOT_REPRODUCED
    del off["metrics"]["agent"]
    assert F.check_jump_forward({"configs": [base, off]})["status"] == F.NOT_TESTED
    assert F.check_jump_forward({"configs": [base]})["status"] == F.NOT_TESTED


def test_memory_finding_from_two_runs():
    from leverlab.study.compare import memory_finding

    rows = [{"speedup_over_bandwidth": x} for x in (1.05, 0.9, None)]
    assert memory_finding(rows, 2.0)["status"] == F.REPRODUCED
    assert memory_finding(rows + [{"speedup_over_bandwidth": 0.5}], 2.0)["status"] == F.PARTLY
    assert "same rate" in memory_finding(rows, 1.03)["why"]  # one machine, two engines: nothing to test
    assert memory_finding(rows, None)["status"] == F.NOT_TESTED
