"""The nearest-parent rule (leverlab/study/substitute.py) against a fake engine that lacks EAGLE, TP and DP, as
llama.cpp does: the champion runs as int4 + n-gram, its descendants follow, a step's own lever is never swapped."""

from __future__ import annotations

from leverlab.study.plan import Levers, Plan, PlanBuilder, default_plan
from leverlab.study.substitute import introducer, resolve_plan


def no_eagle(levers: Levers) -> dict[str, str]:
    gaps = {}
    if (levers.speculative or {}).get("method") == "eagle":
        gaps["speculation"] = "no EAGLE here"
    if (levers.speculative or {}).get("adaptive"):
        gaps["speculation"] = "no adaptive K"
    if levers.tensor_parallel_size != 1:
        gaps["tensor_parallel"] = "no TP"
    return gaps


def test_the_champion_runs_as_int4_plus_ngram_and_is_compared_with_int8_ngram():
    plan = default_plan()
    r = resolve_plan(plan, no_eagle)
    champ = r["champion"]
    assert champ.substituted and champ.parent == "int8-ngram"
    assert champ.levers.quantization == "int4" and champ.levers.speculative["method"] == "ngram"
    assert champ.levers == plan.step("int8-ngram").levers.take("precision", plan.step("int4").levers)
    (swap,) = champ.swaps
    assert swap == {
        "lever": "speculation",
        "wanted": "eagle K=3",
        "used": "ngram K=4",
        "from_step": "int8-ngram",
        "instead_of_step": "int8-eagle",
        "why": "no EAGLE here",
    }
    rec = champ.record(plan.step("champion"), "fake")
    assert rec["label"] == "int4 + ngram K=4 in place of eagle K=3 (from int8-ngram: no EAGLE here)"
    assert rec["plan_parent"] == "int8-eagle" and rec["levers"]["quantization"] == "int4"
    # descendants follow: DP=2 of the substituted champion, compared with it; TP=2 is the step's own lever
    dp2 = r["champion-dp2"]
    assert dp2.substituted and dp2.parent == "champion" and dp2.levers.data_parallel_size == 2
    assert dp2.levers.speculative["method"] == "ngram"
    assert "tensor_parallel" in no_eagle(r["champion-tp2"].levers)
    # what the engine can express runs as planned, against its plan parent
    for name in ("int8", "int4", "int8-ngram", "int8-draft", "no-prefix-cache", "smaller-model"):
        assert not r[name].substituted and r[name].levers == plan.step(name).levers
        assert r[name].parent == plan.step(name).parent
    # the step whose own lever is unsupported is not swapped: it stays as planned (not available)
    assert not r["int8-eagle"].substituted and not r["int8-ngram-adaptive"].substituted


def test_first_sibling_in_plan_order_that_the_engine_takes_as_a_whole():
    plan = default_plan()
    # the engine's precheck refuses int4 with n-gram: the next sibling (the draft model) stands in
    r = resolve_plan(
        plan,
        no_eagle,
        runnable=lambda lv: not no_eagle(lv)
        and not (lv.quantization == "int4" and (lv.speculative or {}).get("method") == "ngram"),
    )
    assert r["champion"].levers.speculative["method"] == "draft_model"
    assert r["champion"].parent == "int8-draft" and r["champion"].swaps[0]["from_step"] == "int8-draft"


def test_a_value_refused_at_start_up_is_replaced_for_the_descendants():
    plan = default_plan()
    # an engine that said nothing up front but refused int8-eagle when its server started
    r = resolve_plan(plan, lambda lv: {}, refused={"int8-eagle": "speculation: eagle is not built"})
    assert r["champion"].levers.speculative["method"] == "ngram"
    assert r["champion"].swaps[0]["why"] == "speculation: eagle is not built"
    assert r["champion-tp2"].levers.tensor_parallel_size == 2 and r["champion-tp2"].parent == "champion"
    # every sibling refused too: nothing stands in, the step stays as planned
    r = resolve_plan(plan, lambda lv: {}, refused={k: "no" for k in ("int8-eagle", "int8-ngram", "int8-draft")})
    assert not r["champion"].substituted and r["champion"].levers == plan.step("champion").levers


def test_no_sibling_means_not_available_and_the_baselines_own_value_is_never_swapped():
    b = PlanBuilder(levers=Levers(tensor_parallel_size=2))
    b.step("int8", "precision", "int8")
    plan = Plan("p", b.steps)
    r = resolve_plan(plan, no_eagle)
    assert not r["int8"].substituted and r["int8"].levers.tensor_parallel_size == 2
    b = PlanBuilder()
    b.step("eagle", "speculation", {"method": "eagle", "model": "h", "num_speculative_tokens": 3})
    b.step("eagle-int8", "precision", "int8")
    plan = Plan("p", b.steps)
    assert introducer(plan, plan.step("eagle-int8"), "speculation").name == "eagle"
    assert not resolve_plan(plan, no_eagle)["eagle-int8"].substituted  # eagle has no sibling


def test_an_engine_that_expresses_everything_runs_the_plan_as_written():
    plan = default_plan()
    r = resolve_plan(plan, lambda lv: {})
    assert all(not x.substituted and x.levers == plan.step(n).levers for n, x in r.items())
    assert [r[s.name].parent for s in plan.steps] == [s.parent for s in plan.steps]
