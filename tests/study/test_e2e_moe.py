"""`leverlab study` end to end on a tiny random Qwen3-MoE checkpoint (baseline and int8, through real `leverlab serve`
processes): every configuration completes, and the bandwidth model's bytes per pass are the weight bytes the server
counted from its router's choices (leverlab_engine_moe_*), not the active-expert estimate."""

from __future__ import annotations

import pytest

from leverlab.models.config import ModelConfig
from leverlab.study.engines.leverlab import LeverLabEngine
from leverlab.study.plan import Levers, Plan, PlanBuilder
from leverlab.study.predict import kv_bytes_per_token
from leverlab.study.report import write_report
from leverlab.study.runner import run_study
from tests.study.test_e2e import write_workload


def moe_plan() -> Plan:
    b = PlanBuilder(levers=Levers(dtype="float32"))
    b.step("int8", "precision", "int8")
    return Plan("tiny-moe", b.steps, buckets=["short"], num_prompts=2, concurrency=[1, 2], sweep_bucket="short",
                sweep_rounds=1, warmup=1, fidelity_prompts=2, fidelity_tokens=12)


@pytest.fixture(scope="module")
def study(checkpoint_factory, tmp_path_factory):
    ckpt = checkpoint_factory("qwen3-moe")
    tmp = tmp_path_factory.mktemp("study-moe")
    out = tmp / "study"
    state = run_study(moe_plan(), LeverLabEngine(execution_mode="eager"), ckpt, out,
                      source_workload=write_workload(tmp / "workload.json"), bandwidth_gbs=10.0)
    return ckpt, out, state, write_report(out)


def test_the_study_runs_on_a_mixture_of_experts_model(study):
    _, _, state, a = study
    assert [c["name"] for c in a["configs"]] == ["baseline", "int8"]
    for c in a["configs"]:
        assert c["status"] == "done", (c["name"], c.get("reason"), state.data["configs"][c["name"]].get("log_tail"))
        assert c["metrics"]["decode_tok_s"] > 0 and c["metrics"]["request_errors"] == 0
        assert c["prediction"]["roofline_tok_s"] > 0 and c["prediction"]["calibrated_tok_s"] > 0
    assert a["model_facts"]["moe"] is True
    assert a["configs"][0]["fidelity"]["agreement"]["share_identical"] == 1.0


def test_the_roofline_uses_the_weight_bytes_the_server_measured(study):
    ckpt, out, _, a = study
    cfg = ModelConfig.from_folder(ckpt)
    base, int8 = a["configs"]
    # One stream: each sparse layer reads exactly top-k experts, so the float32 baseline's bytes per pass are the
    # active-weight estimate less the untied embedding table, plus the q/k norms the estimate leaves out.
    one_stream = 4 * (cfg.num_params(active=True) - cfg.vocab_size * cfg.hidden_size + cfg.num_layers * 2 * cfg.head_dim)
    assert base["metrics"]["weight_bytes_per_pass"] == one_stream
    assert 0 < int8["metrics"]["weight_bytes_per_pass"] < 0.5 * one_stream
    # At two streams the sequences' experts add up: more than one stream's, at most every expert.
    assert base["metrics"]["weight_bytes_per_pass_cmax"] > one_stream
    kv = kv_bytes_per_token(_facts(a), Levers(dtype="float32")) * a["prediction_context_tokens"]
    for c in (base, int8):
        p = c["prediction"]
        assert p["weight_bytes_source"] == "measured" and p["load_weight_bytes_source"] == "measured"
        assert p["bytes_per_pass"] == pytest.approx(c["metrics"]["weight_bytes_per_pass"] + kv)
    md = (out / "report.md").read_text().split("## Predicted against measured")[1]
    assert "(measured)" in md and "(estimate)" not in md and "leverlab_engine_moe_weight_bytes_read_total" in md


def _facts(a):
    from leverlab.study.predict import ModelFacts

    return ModelFacts(**a["model_facts"])
