"""Plans from files and flags: a YAML or TOML plan (load_plan, plan_from_dict) and `--steps` (plan_from_steps_arg,
parse_value), turned into plan.Plan and checked as plans made in code are.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from leverlab.study.plan import LEVERS, Levers, Plan, PlanBuilder, PlanError


def load_plan(path: str | Path) -> Plan:
    """A YAML or TOML plan:

    name = "mine"
    num_prompts = 2
    concurrency = [1, 2]
    [baseline]
    dtype = "float32"
    [[steps]]
    name = "int8"
    precision = "int8"            # exactly one lever key per step
    [[steps]]
    name = "ngram"
    parent = "int8"
    speculation = { method = "ngram", num_speculative_tokens = 4 }
    """
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".toml":
        raw = tomllib.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: a plan file must be a mapping")
    return plan_from_dict(raw, default_name=path.stem)


PLAN_KEYS = {
    "buckets",
    "num_prompts",
    "output_scale",
    "concurrency",
    "sweep_bucket",
    "sweep_rounds",
    "warmup",
    "fidelity_prompts",
    "fidelity_tokens",
    "exactness",
}


def plan_from_dict(raw: dict[str, Any], default_name: str = "plan") -> Plan:
    unknown = set(raw) - PLAN_KEYS - {"name", "baseline", "steps"}
    if unknown:
        raise PlanError(
            f"unknown plan keys {sorted(unknown)}; known: {sorted(PLAN_KEYS | {'name', 'baseline', 'steps'})}"
        )
    base_raw = dict(raw.get("baseline") or {})
    base_name = base_raw.pop("name", "baseline")
    base_note = str(base_raw.pop("note", ""))
    try:
        base = Levers(**base_raw)
    except TypeError as e:
        raise PlanError(f"baseline: {e}") from None
    b = PlanBuilder(base_name, base, base_note)
    for i, s in enumerate(raw.get("steps") or []):
        s = dict(s)
        name = s.pop("name", None) or f"step{i + 1}"
        parent = s.pop("parent", None)
        note = s.pop("note", "")
        single = s.pop("single_buckets", None)
        keys = [k for k in s if k in LEVERS]
        extra = [k for k in s if k not in LEVERS]
        if extra:
            raise PlanError(
                f"step {name!r}: unknown keys {extra}; a step names one lever of {', '.join(LEVERS)}"
            )
        if len(keys) != 1:
            raise PlanError(f"step {name!r} must set exactly one lever, sets {keys or 'none'}")
        b.step(name, keys[0], s[keys[0]], parent=parent, note=note, single_buckets=single)
    kw = {k: raw[k] for k in PLAN_KEYS if k in raw}
    return Plan(raw.get("name", default_name), b.steps, **kw)


def plan_from_steps_arg(spec: str, baseline: Levers | None = None) -> Plan:
    """--steps 'int8:precision=int8,ngram:speculation=ngram/4,fp32:precision=float32@baseline'.

    Each item is NAME:LEVER=VALUE[@PARENT]; speculation values are METHOD[/K][/adaptive].
    """
    b = PlanBuilder(levers=baseline)
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            name, rest = item.split(":", 1)
            rest, _, parent = rest.partition("@")
            lever, value = rest.split("=", 1)
        except ValueError:
            raise PlanError(f"--steps item {item!r} is not NAME:LEVER=VALUE[@PARENT]") from None
        b.step(name, lever, parse_value(lever, value), parent=parent or None)
    return Plan("custom", b.steps)


def parse_value(lever: str, value: str) -> Any:
    if lever == "speculation":
        if value in ("none", "off"):
            return None
        parts = value.split("/")
        d: dict[str, Any] = {
            "method": parts[0],
            "num_speculative_tokens": int(parts[1]) if len(parts) > 1 else 4,
        }
        if "adaptive" in parts[2:]:
            d["adaptive"] = True
        return d
    if lever == "prefix_caching":
        if value.lower() not in ("on", "off", "true", "false"):
            raise PlanError(f"prefix_caching is on or off, got {value!r}")
        return value.lower() in ("on", "true")
    if lever == "structured":
        if value.lower() not in ("on", "off", "true", "false"):
            raise PlanError(f"structured (jump-forward) is on or off, got {value!r}")
        return value.lower() in ("on", "true")
    if lever in ("tensor_parallel", "replicas", "batch_policy"):
        return int(value)
    return value  # precision, kv_cache_dtype, batching, model: as written
