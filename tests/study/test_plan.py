from __future__ import annotations

import pytest

from leverlab.study.plan import (
    LEVERS,
    Levers,
    Plan,
    PlanBuilder,
    PlanError,
    Step,
    default_plan,
    full_plan,
)
from leverlab.study.plan_files import load_plan, plan_from_dict, plan_from_steps_arg


def test_default_plan_follows_the_reference_progression():
    plan = default_plan()
    names = [s.name for s in plan.steps]
    assert names == [
        "baseline",
        "int8",
        "int4",
        "int8-ngram",
        "int8-ngram-adaptive",
        "int8-draft",
        "int8-eagle",
        "champion",
        "champion-tp2",
        "champion-dp2",
        "no-prefix-cache",
        "static-batching",
        "smaller-model",
    ]
    # every finding one machine can test gets its step: prefix caching, static batching (B), right-sizing (R)
    byn = {s.name: s for s in plan.steps}
    assert byn["no-prefix-cache"].levers.prefix_caching is False and byn["no-prefix-cache"].parent == "baseline"
    assert byn["static-batching"].levers.batching == "static" and byn["static-batching"].parent == "baseline"
    assert byn["smaller-model"].levers.model == "models/leverlab-code-draft"
    champ = plan.step("champion").levers
    assert champ.quantization == "int4" and champ.speculative["method"] == "eagle"
    assert plan.step("champion-tp2").levers.tensor_parallel_size == 2
    # replicas beside TP on the same parent: the report's replicas-vs-TP finding compares the two
    dp2 = plan.step("champion-dp2")
    assert dp2.parent == "champion" and dp2.levers.data_parallel_size == 2 and dp2.change == "replicas: DP=2"
    assert plan.concurrency[0] == 1 and max(plan.concurrency) == 16


def test_full_plan_covers_every_lever():
    levers = {s.lever for s in full_plan().steps if s.lever}
    assert levers == set(LEVERS)
    # the default plan's steps in place, the full plan's own between them, in the order --full always had
    assert [s.name for s in full_plan().steps][10:] == [
        "int8-kv-int8", "no-prefix-cache", "baseline-tp2", "max-seqs-4", "static-batching", "smaller-model",
        "no-jump-forward",
    ]
    byn = {s.name: s for s in full_plan().steps}
    assert byn["static-batching"].levers.batching == "static" and byn["static-batching"].parent == "baseline"
    assert byn["smaller-model"].levers.model == "models/leverlab-code-draft"


def test_a_step_may_run_its_concurrency_1_pass_over_some_buckets_only():
    plan = plan_from_dict(
        {"steps": [{"name": "st", "batching": "static", "single_buckets": ["medium"]}, {"name": "i8", "precision": "int8"}]}
    )
    assert plan.steps[1].single_buckets == ("medium",) and plan.steps[2].single_buckets is None
    assert plan.to_json()["steps"][1]["single_buckets"] == ("medium",)
    with pytest.raises(PlanError, match="single_buckets is a list of bucket names"):
        plan_from_dict({"steps": [{"name": "st", "batching": "static", "single_buckets": "medium"}]})


def test_batching_and_model_levers_parse_and_refuse_bad_values():
    plan = plan_from_steps_arg("st:batching=static,small:model=models/leverlab-code-draft@baseline")
    st, small = plan.steps[1], plan.steps[2]
    assert st.lever == "batching" and st.change == "batching: static batches (N = concurrency)"
    assert small.levers.model == "models/leverlab-code-draft" and small.change == "model: leverlab-code-draft"
    with pytest.raises(PlanError, match="batching is one of continuous, static"):
        plan_from_steps_arg("x:batching=dynamic")
    with pytest.raises(PlanError, match="model is a model folder"):
        plan_from_dict({"steps": [{"name": "m", "model": 3}]})


def test_default_plan_checks_exactness_where_speculation_changes():
    plan = default_plan()
    checked = [s.name for s in plan.steps if plan.checks_exactness(s)]
    assert checked == ["int8-ngram", "int8-ngram-adaptive", "int8-draft", "int8-eagle"]
    assert plan.warmup == 1 and plan.num_prompts == 4
    full = full_plan()
    assert {"champion", "champion-tp2"} <= {s.name for s in full.steps if full.checks_exactness(s)}


def test_every_step_changes_exactly_one_lever_from_its_parent():
    for plan in (default_plan(), full_plan()):
        by = {s.name: s for s in plan.steps}
        for s in plan.steps[1:]:
            assert s.levers.changed_levers(by[s.parent].levers) == [s.lever]


def test_a_step_changing_two_levers_is_refused():
    base = Step("baseline", None, None, Levers())
    two = Step("x", "baseline", "precision", Levers(quantization="int8", kv_cache_dtype="int8"))
    with pytest.raises(PlanError, match="exactly one lever.*changes precision, kv_cache_dtype"):
        Plan("bad", [base, two])


def test_a_step_changing_nothing_is_refused():
    with pytest.raises(PlanError, match="changes nothing"):
        PlanBuilder().step("same", "precision", "bfloat16")
        Plan("bad", PlanBuilder().step("same", "precision", "bfloat16").steps)


def test_unknown_parent_and_duplicate_names_are_refused():
    base = Step("baseline", None, None, Levers())
    with pytest.raises(PlanError, match="not an earlier step"):
        Plan("bad", [base, Step("x", "nope", "precision", Levers(quantization="int8"))])
    with pytest.raises(PlanError, match="used twice"):
        Plan("bad", [base, Step("baseline", "baseline", "precision", Levers(quantization="int8"))])


def test_a_step_that_mislabels_its_lever_is_refused():
    base = Step("baseline", None, None, Levers())
    with pytest.raises(PlanError, match="says it changes 'kv_cache_dtype' but changes 'precision'"):
        Plan("bad", [base, Step("x", "baseline", "kv_cache_dtype", Levers(quantization="int8"))])


def test_toml_plan(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text(
        """
name = "mine"
num_prompts = 3
concurrency = [1, 2]
[baseline]
dtype = "float32"
[[steps]]
name = "int8"
precision = "int8"
[[steps]]
name = "ng"
parent = "int8"
speculation = { method = "ngram", num_speculative_tokens = 4 }
[[steps]]
name = "nopc"
parent = "baseline"
prefix_caching = false
"""
    )
    plan = load_plan(f)
    assert plan.name == "mine" and plan.num_prompts == 3 and plan.concurrency == [1, 2]
    assert plan.steps[0].levers.dtype == "float32"
    assert plan.step("ng").levers.quantization == "int8"
    assert plan.step("ng").levers.speculative == {"method": "ngram", "num_speculative_tokens": 4}
    assert plan.step("nopc").levers.prefix_caching is False


def test_yaml_plan_with_two_levers_in_one_step_is_refused(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("steps:\n  - name: x\n    precision: int8\n    kv_cache_dtype: int8\n")
    with pytest.raises(PlanError, match="exactly one lever"):
        load_plan(f)


def test_steps_argument():
    plan = plan_from_steps_arg(
        "int8:precision=int8,ng:speculation=ngram/5/adaptive,nopc:prefix_caching=off@baseline"
    )
    assert plan.step("ng").levers.speculative == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "adaptive": True,
    }
    assert plan.step("ng").parent == "int8"
    assert plan.step("nopc").parent == "baseline" and plan.step("nopc").levers.prefix_caching is False
    with pytest.raises(PlanError, match="NAME:LEVER=VALUE"):
        plan_from_steps_arg("garbage")


def test_study_workload_subset_and_fidelity_prompts(tmp_path):
    import json
    from pathlib import Path

    from leverlab.study.runner import fidelity_prompts, prepare_workload

    plan = default_plan()
    src = Path(__file__).resolve().parents[2] / "models" / "workload.json"
    wl = prepare_workload(src, plan, tmp_path / "w.json")
    b = json.loads(wl.read_text())["buckets"]
    assert list(b) == ["short", "medium", "long", "decode"]
    assert all(len(v["prompts"]) == 4 for v in b.values())
    assert b["medium"]["output_len"] == 128 and b["decode"]["output_len"] == 512  # halved, 1:4 kept
    picked = fidelity_prompts(wl, 4)
    assert [p["id"].split("-")[0] for p in picked] == ["short", "decode", "medium", "long"]


def test_structured_lever_and_who_runs_the_agent_workload():
    from leverlab.study.plan import full_plan
    from leverlab.study.plan_files import parse_value

    p = full_plan()
    step = p.step("no-jump-forward")
    assert step.lever == "structured" and step.levers.structured_jump_forward is False
    assert step.levers.describe("structured") == "jump-forward off"
    assert p.runs_agent(step) and p.runs_agent(p.step("baseline")) and not p.runs_agent(p.step("int8"))
    assert parse_value("structured", "off") is False and parse_value("structured", "on") is True
