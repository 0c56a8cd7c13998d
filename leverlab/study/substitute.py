"""Nearest parent: what a configuration runs as on an engine that cannot express a lever value it inherits.

A plan is one tree for every engine, but engines differ: llama.cpp has no EAGLE, so the plan's `champion`
(int4 on top of `int8-eagle`) would read "not available" there, and so would every step below it, although
the one thing llama.cpp lacks is a value the champion only inherits. The rule, per configuration S and engine E:

1. S's own lever is never substituted: if E cannot express the value S sets, S is not available on E (the
   study measures that lever, so any stand-in would measure something else).
2. An inherited lever value E cannot express (its unsupported(), or the step that introduced the value was
   refused by E at start-up in this study) is replaced by the value of a *sibling* of the step A that
   introduced it: a step with A's parent that changes the same lever (int8-eagle's siblings on speculation
   are int8-ngram and int8-draft), taking the first in plan order with which E can express S as a whole.
   Plan order, not a measured best: the substitution is then known before anything runs (resume, --only, the
   progress estimate), the same on every run, and plans list a lever's alternatives from the plainest and most
   widely expressible to the most specialised (n-gram, a draft model, a trained head), as the reference did.
   Every sibling's own numbers are in the report beside it.
3. No such sibling (or several inherited gaps and one cannot be filled): S is not available, with E's reason.
4. S is then compared with the *effective parent*: the earlier step whose configuration on E equals S's
   with S's own lever as S's plan parent has it (llama.cpp's champion: int8-ngram), so it still changes one
   lever from what it is set against. Descendants follow: champion-tp2 inherits the stand-in through the
   same rule and is compared with the substituted champion.

A substitution is recorded in the configuration's entry of study.json ("substitution") and labelled in every
report, e.g. "int4 + ngram K=4 in place of eagle K=3 (from int8-ngram; llamacpp: no EAGLE here ...)".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from leverlab.study.plan import LEVERS, Levers, Plan, Step


@dataclass
class Resolved:
    """How one configuration runs on one engine."""

    levers: Levers
    parent: str | None  # the step it is compared with (the plan's parent, or the substitution's)
    swaps: list[dict[str, Any]] = field(default_factory=list)  # one per substituted lever

    @property
    def substituted(self) -> bool:
        return bool(self.swaps)

    def record(self, step: Step, engine: str) -> dict[str, Any] | None:
        """What study.json keeps ("substitution" in the configuration's entry); None when nothing changed."""
        if not self.swaps:
            return None
        return {
            "engine": engine,
            "parent": self.parent,
            "plan_parent": step.parent,
            "levers": asdict(self.levers),
            "swaps": self.swaps,
            "label": label(step, self),
        }


def introducer(plan: Plan, step: Step, lever: str) -> Step | None:
    """The nearest ancestor of `step` (itself excluded) that set `lever`: where an inherited value comes from.
    None when the value is the baseline's own."""
    byn = {s.name: s for s in plan.steps}
    p = byn.get(step.parent or "")
    while p is not None and p.parent is not None:
        if p.lever == lever:
            return p
        p = byn.get(p.parent)
    return None


def resolve_plan(
    plan: Plan,
    gaps_of: Callable[[Levers], dict[str, str]],
    runnable: Callable[[Levers], bool] | None = None,
    refused: dict[str, str] | None = None,
) -> dict[str, Resolved]:
    """Every step's Resolved on one engine. gaps_of: the engine's unsupported(levers) (lever -> reason);
    runnable: whether the engine takes a whole configuration (its precheck too), for candidate stand-ins;
    refused: steps the engine refused at start-up in this study (name -> reason), whose values count as
    unsupported for their descendants."""
    refused = refused or {}
    runnable = runnable or (lambda lv: not gaps_of(lv))
    out: dict[str, Resolved] = {}
    for step in plan.steps:
        out[step.name] = _resolve(plan, step, gaps_of, runnable, refused, out)
    return out


def _resolve(plan, step, gaps_of, runnable, refused, done: dict[str, Resolved]) -> Resolved:
    if step.parent is None:
        return Resolved(step.levers, None)
    # Start from the parent as it runs on this engine: a substituted parent passes its stand-in down.
    parent = done[step.parent]
    levers = parent.levers.take(step.lever, step.levers) if step.lever else step.levers
    swaps = [dict(s) for s in parent.swaps]
    gaps = _gaps(plan, step, levers, gaps_of, refused)
    inherited = [g for g in LEVERS if g in gaps and g != step.lever]
    if step.lever in gaps or not inherited:
        # Nothing to fill, or the step's own value is what the engine lacks: as inherited (the runner then
        # reports the engine's reason if it cannot run).
        return Resolved(levers, _effective_parent(plan, step, levers, done), swaps)
    for i, g in enumerate(inherited):
        src = introducer(plan, step, g)
        if src is None:
            return Resolved(levers, step.parent, swaps)  # the baseline's own value: nothing to stand in
        wanted, last = levers, i == len(inherited) - 1
        for cand in plan.steps:
            if cand.lever != g or cand.parent != src.parent or cand.name in (src.name, step.name):
                continue
            if cand.name in refused:
                continue
            trial = levers.take(g, cand.levers)
            # The last gap's stand-in must make the whole configuration runnable (the engine's precheck
            # too), so a later sibling gets its turn when an earlier one fills the gap but is refused.
            if g in gaps_of(trial) or (last and not runnable(trial)):
                continue
            levers = trial
            swaps = [s for s in swaps if s["lever"] != g] + [
                {
                    "lever": g,
                    "wanted": wanted.describe(g),
                    "used": trial.describe(g),
                    "from_step": cand.name,
                    "instead_of_step": src.name,
                    "why": gaps[g],
                }
            ]
            break
        else:
            return Resolved(step.levers, step.parent, [])
    if _gaps(plan, step, levers, gaps_of, refused) or not runnable(levers):
        return Resolved(step.levers, step.parent, [])
    return Resolved(levers, _effective_parent(plan, step, levers, done), swaps)


def _gaps(plan: Plan, step: Step, levers: Levers, gaps_of, refused: dict[str, str]) -> dict[str, str]:
    gaps = dict(gaps_of(levers))
    for lever in LEVERS:
        if lever == step.lever or lever in gaps:
            continue
        src = introducer(plan, step, lever)
        # The value still comes from a refused step (not already swapped for a sibling's).
        if src is not None and src.name in refused and levers.describe(lever) == src.levers.describe(lever):
            gaps[lever] = refused[src.name]
    return gaps


def _effective_parent(plan: Plan, step: Step, levers: Levers, done: dict[str, Resolved]) -> str | None:
    """The earlier step whose configuration (as it runs here) is this one with the step's own lever as the
    plan parent has it: the plan's parent when nothing was substituted."""
    want = levers.take(step.lever, plan.step(step.parent).levers)
    if done[step.parent].levers == want:
        return step.parent
    for s in plan.steps:
        if s.name == step.name:
            break
        if s.name in done and done[s.name].levers == want:
            return s.name
    return step.parent


def label(step: Step, r: Resolved) -> str:
    """'int4 + ngram K=4 in place of eagle K=3 (from int8-ngram; the engine: no EAGLE ...)'."""
    own = r.levers.describe(step.lever) if step.lever else "baseline"
    parts = " + ".join(f"{s['used']} in place of {s['wanted']}" for s in r.swaps)
    srcs = "; ".join(f"from {s['from_step']}: {s['why']}" for s in r.swaps)
    return f"{own} + {parts} ({srcs})"
