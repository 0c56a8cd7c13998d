"""A study plan: a baseline and steps, each changing exactly one lever from its parent.

    baseline ─ int8 ─ int4 ─ ...        every step names its parent (default: the step above) and one lever;
                 └─ int8+ngram ─ ...    validate() refuses a step that changes zero or several levers.

Levers and the fields they own (a lever is the unit of "one change"):
  precision        dtype + quantization (weights)            "int8", "int4", "bfloat16", "float32", "fp8"...
  kv_cache_dtype   KV-cache element type                     "auto", "int8", "fp8"
  speculation      method, K, adaptive, draft/head folder    {"method": "ngram", "num_speculative_tokens": 4}
  prefix_caching   automatic prefix caching on/off           true / false
  tensor_parallel  tensor-parallel degree                    1, 2, 4
  replicas         data-parallel replicas (engine processes)  1, 2
  batch_policy     max_num_seqs (sequences per step)         16, 64
  batching         how requests meet the server              "continuous" (default), "static" (waves of N =
                                                             the concurrency; a client-side workload)
  model            right-sizing: serve another model         a folder of the same family ("models/...-draft")
  structured       structured output's jump-forward on/off   true / false (the step and its parent also run
                                                             the agent workload: tool calls, JSON schemas)
Adding a lever: its name in LEVERS, its field on Levers, and one entry in each of LEVER_FIELDS / lever_values /
with_lever / describe (and parse_value for --steps); engines say what they cannot express in unsupported().
Plans come from code (default_plan / full_plan / tiny_plan) or a YAML/TOML file (plan_files.load_plan).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

LEVERS = (
    "precision",
    "kv_cache_dtype",
    "speculation",
    "prefix_caching",
    "tensor_parallel",
    "replicas",
    "batch_policy",
    "batching",
    "model",
    "structured",
)
# The Levers fields each lever owns (Levers.take copies them from one configuration into another).
LEVER_FIELDS = {
    "precision": ("dtype", "quantization"),
    "kv_cache_dtype": ("kv_cache_dtype",),
    "speculation": ("speculative",),
    "prefix_caching": ("prefix_caching",),
    "tensor_parallel": ("tensor_parallel_size",),
    "replicas": ("data_parallel_size",),
    "batch_policy": ("max_num_seqs",),
    "batching": ("batching",),
    "model": ("model",),
    "structured": ("structured_jump_forward",),
}
BATCHING = ("continuous", "static")
DTYPES = ("bfloat16", "float16", "float32")


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Levers:
    """One configuration's lever settings (engine-neutral; engines map them onto their flags)."""

    dtype: str = "bfloat16"
    quantization: str | None = None  # None: weights in `dtype`
    kv_cache_dtype: str = "auto"
    speculative: dict | None = None  # vLLM's --speculative-config shape
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # replicas behind one endpoint (--data-parallel-size)
    max_num_seqs: int = 64
    batching: str = "continuous"  # "static": the harness sends waves (bench/strategies.py static_batches)
    model: str | None = None  # None: the study's model; else a smaller model of its family (right-sizing)
    structured_jump_forward: bool = True  # --structured-outputs-jump-forward (read by the agent workload)

    def lever_values(self) -> dict[str, Any]:
        """Lever name -> the value that lever owns (what 'changes one lever' compares)."""
        return {
            "precision": (self.dtype, self.quantization),
            "kv_cache_dtype": self.kv_cache_dtype,
            "speculation": json.dumps(self.speculative, sort_keys=True) if self.speculative else None,
            "prefix_caching": self.prefix_caching,
            "tensor_parallel": self.tensor_parallel_size,
            "replicas": self.data_parallel_size,
            "batch_policy": self.max_num_seqs,
            "batching": self.batching,
            "model": self.model,
            "structured": self.structured_jump_forward,
        }

    def take(self, lever: str, other: Levers) -> Levers:
        """A copy with one lever's fields as `other` has them (what a substitution swaps in)."""
        return replace(self, **{f: getattr(other, f) for f in LEVER_FIELDS[lever]})

    def changed_levers(self, other: Levers) -> list[str]:
        a, b = self.lever_values(), other.lever_values()
        return [k for k in LEVERS if a[k] != b[k]]

    def with_lever(self, lever: str, value: Any) -> Levers:
        """A copy with one lever set. precision: "int8"/"int4"/... (quantization) or a dtype name."""
        if lever == "precision":
            if isinstance(value, dict):
                return replace(
                    self, dtype=value.get("dtype", self.dtype), quantization=value.get("quantization")
                )
            if value in DTYPES:
                return replace(self, dtype=value, quantization=None)
            return replace(self, quantization=None if value in (None, "none") else str(value))
        if lever == "kv_cache_dtype":
            return replace(self, kv_cache_dtype=str(value))
        if lever == "speculation":
            if value in (None, "none", False):
                return replace(self, speculative=None)
            if not isinstance(value, dict) or "method" not in value:
                raise PlanError(f"speculation must be a table with a 'method', got {value!r}")
            return replace(self, speculative=dict(value))
        if lever == "prefix_caching":
            if not isinstance(value, bool):
                raise PlanError(f"prefix_caching must be true or false, got {value!r}")
            return replace(self, prefix_caching=value)
        if lever == "tensor_parallel":
            return replace(self, tensor_parallel_size=int(value))
        if lever == "replicas":
            return replace(self, data_parallel_size=int(value))
        if lever == "batch_policy":
            return replace(self, max_num_seqs=int(value))
        if lever == "batching":
            if value not in BATCHING:
                raise PlanError(f"batching is one of {', '.join(BATCHING)}, got {value!r}")
            return replace(self, batching=value)
        if lever == "structured":
            if not isinstance(value, bool):
                raise PlanError(f"structured (jump-forward) must be true or false, got {value!r}")
            return replace(self, structured_jump_forward=value)
        if lever == "model":
            if value in (None, "", "none"):
                return replace(self, model=None)
            if not isinstance(value, str):
                raise PlanError(f"model is a model folder, got {value!r}")
            return replace(self, model=value)
        raise PlanError(f"unknown lever {lever!r}; levers: {', '.join(LEVERS)}")

    def precision_label(self) -> str:
        return self.quantization or self.dtype

    def speculation_label(self) -> str:
        s = self.speculative
        if not s:
            return "none"
        k = s.get("num_speculative_tokens", "?")
        return f"{s['method']} K={k}" + (" adaptive" if s.get("adaptive") else "")

    def describe(self, lever: str) -> str:
        """The value of one lever, for tables ("int8", "ngram K=4 adaptive", "off", "TP=2")."""
        if lever == "precision":
            return self.precision_label()
        if lever == "kv_cache_dtype":
            return "model dtype" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        if lever == "speculation":
            return self.speculation_label()
        if lever == "prefix_caching":
            return "on" if self.prefix_caching else "off"
        if lever == "tensor_parallel":
            return f"TP={self.tensor_parallel_size}"
        if lever == "batching":
            return "static batches (N = concurrency)" if self.batching == "static" else "continuous"
        if lever == "model":
            return Path(self.model).name if self.model else "the study's model"
        if lever == "replicas":
            return f"DP={self.data_parallel_size}"
        if lever == "structured":
            return "jump-forward " + ("on" if self.structured_jump_forward else "off")
        return f"max_num_seqs={self.max_num_seqs}"


@dataclass(frozen=True)
class Step:
    name: str
    parent: str | None  # None: the baseline
    lever: str | None  # None: the baseline
    levers: Levers
    note: str = ""
    # The concurrency-1 pass over these buckets only (None: every bucket of the plan); the sweep bucket always
    # runs. For steps whose finding reads only the sweep bucket (static batches, prefix caching, a smaller
    # model): the other buckets' c=1 requests, the decode bucket's above all, would cost time and tell nothing.
    single_buckets: tuple[str, ...] | None = None

    @property
    def change(self) -> str:
        if self.lever is None:
            return "baseline"
        return f"{self.lever}: {self.levers.describe(self.lever)}"


@dataclass
class Plan:
    name: str
    steps: list[Step]
    # workload: how much of the prompt set each configuration runs
    buckets: list[str] | None = None  # None: every bucket of the prompt set
    num_prompts: int | None = 2  # per bucket (None: the whole bucket)
    output_scale: float = 1.0  # output lengths x this (short plan: 0.5 keeps the 1:4 ratio, halves the time)
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    sweep_bucket: str = "medium"
    sweep_rounds: int = 1
    warmup: int = 2
    fidelity_prompts: int = 4  # prompts for the fidelity pass
    fidelity_tokens: int = 64  # greedy tokens compared per prompt
    # Where speculation's exactness (spec on vs off, float32) is checked: "every" speculative configuration, or
    # only the "speculation" steps (those that change it). A step changing another lever under speculation
    # (int4 + EAGLE) keeps its parent's check; its float32 pair is the run's most expensive part (int4 has
    # no float32 kernel: ~65 s each), which the short plan skips and --full keeps.
    exactness: str = "every"

    def __post_init__(self) -> None:
        validate(self.steps)
        if self.exactness not in ("every", "speculation"):
            raise PlanError(f"exactness is 'every' or 'speculation', got {self.exactness!r}")

    def runs_agent(self, step: Step) -> bool:
        """Whether this configuration also runs the agent workload: a structured step, or the parent of one."""
        return step.lever == "structured" or any(s.lever == "structured" and s.parent == step.name
                                                 for s in self.steps)

    def checks_exactness(self, step: Step) -> bool:
        if not step.levers.speculative:
            return False
        return self.exactness == "every" or step.lever == "speculation"

    def step(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = [{**asdict(s), "change": s.change} for s in self.steps]
        return d


def validate(steps: list[Step]) -> None:
    if not steps:
        raise PlanError("a plan needs at least a baseline")
    if steps[0].parent is not None:
        raise PlanError(f"the first step ({steps[0].name!r}) must be the baseline (no parent)")
    seen: dict[str, Step] = {}
    for s in steps:
        if s.name in seen:
            raise PlanError(f"step name {s.name!r} is used twice")
        if not s.name or any(c in s.name for c in "/\\ "):
            raise PlanError(f"step name {s.name!r} must be non-empty without '/', '\\' or spaces")
        if s.parent is None:
            if s is not steps[0]:
                raise PlanError(f"only the first step may be a baseline; {s.name!r} has no parent")
        else:
            if s.parent not in seen:
                raise PlanError(f"step {s.name!r}: parent {s.parent!r} is not an earlier step")
            changed = s.levers.changed_levers(seen[s.parent].levers)
            if len(changed) != 1:
                what = "nothing" if not changed else ", ".join(changed)
                raise PlanError(
                    f"step {s.name!r} must change exactly one lever from {s.parent!r}; it changes {what}"
                )
            if s.lever != changed[0]:
                raise PlanError(f"step {s.name!r} says it changes {s.lever!r} but changes {changed[0]!r}")
        seen[s.name] = s


class PlanBuilder:
    """baseline(...) then .step(name, lever, value, parent=None): parent defaults to the step above."""

    def __init__(self, name: str = "baseline", levers: Levers | None = None, note: str = ""):
        self.steps = [Step(name, None, None, levers or Levers(), note)]

    def step(
        self,
        name: str,
        lever: str,
        value: Any,
        parent: str | None = None,
        note: str = "",
        single_buckets: tuple[str, ...] | list[str] | None = None,
    ) -> PlanBuilder:
        parent = parent or self.steps[-1].name
        base = next((s for s in self.steps if s.name == parent), None)
        if base is None:
            raise PlanError(f"step {name!r}: parent {parent!r} is not an earlier step")
        if lever not in LEVERS:
            raise PlanError(f"step {name!r}: unknown lever {lever!r}; levers: {', '.join(LEVERS)}")
        if single_buckets is not None and (isinstance(single_buckets, str) or not all(
            isinstance(b, str) for b in single_buckets
        )):
            raise PlanError(f"step {name!r}: single_buckets is a list of bucket names, got {single_buckets!r}")
        self.steps.append(
            Step(
                name,
                parent,
                lever,
                base.levers.with_lever(lever, value),
                note,
                tuple(single_buckets) if single_buckets is not None else None,
            )
        )
        return self


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT_MODEL_DIR = "models/leverlab-code-draft"
EAGLE_HEAD_DIR = "models/leverlab-code-eagle"  # the bundled model's EAGLE head (`leverlab train-eagle`)


def _reference_steps(b: PlanBuilder, *, full: bool) -> PlanBuilder:
    """The reference progression: precision down, then speculation on the 8-bit model, then the stack."""
    b.step("int8", "precision", "int8", note="8-bit weights (the reference's FP8 step)")
    b.step("int4", "precision", "int4", note="4-bit weights, group-wise scales (the reference's AWQ INT4)")
    b.step("int8-ngram", "speculation", NGRAM, parent="int8", note="n-gram (prompt lookup) speculation")
    b.step(
        "int8-ngram-adaptive",
        "speculation",
        {**NGRAM, "adaptive": True},
        note="K chosen per step from measured acceptance and batch size (0 under load)",
    )
    b.step(
        "int8-draft",
        "speculation",
        {"method": "draft_model", "model": DRAFT_MODEL_DIR, "num_speculative_tokens": 4},
        parent="int8",
        note="a separate small draft model",
    )
    b.step(
        "int8-eagle",
        "speculation",
        {"method": "eagle", "model": EAGLE_HEAD_DIR, "num_speculative_tokens": 3},
        parent="int8",
        note="a fused trained head (EAGLE)",
    )
    b.step(
        "champion", "precision", "int4", parent="int8-eagle", note="INT4 + EAGLE: the reference's champion"
    )
    # Steps whose findings read the sweep bucket only (4 and 4b: its c=1 latency and decode rate, output under
    # load; B: the sweep; R: its c=1 decode rate and fidelity; prefix caching: the sweep, whose prompts repeat):
    # in the short plan their concurrency-1 pass skips the other buckets (see default_plan). --full keeps all.
    light = None if full else ()
    b.step("champion-tp2", "tensor_parallel", 2, note="the champion at tensor-parallel size 2",
           single_buckets=light)
    b.step("champion-dp2", "replicas", 2, parent="champion", single_buckets=light,
           note="two replicas of the champion (the same cores as TP=2): the reference's cost-per-token lever")
    # The levers one machine can test beyond the progression. The default plan measures prefix caching, static
    # batching (finding B) and right-sizing (finding R) too, so every finding that does not need a second
    # machine gets numbers; --full adds the KV-cache, TP-on-baseline and batch-policy steps between them (in
    # the order --full always had, so a resumed --full study keeps its step names in place).
    if full:
        b.step("int8-kv-int8", "kv_cache_dtype", "int8", parent="int8", note="8-bit KV cache")
    b.step("no-prefix-cache", "prefix_caching", False, parent="baseline", note="prefix caching off",
           single_buckets=light)
    if full:
        b.step(
            "baseline-tp2", "tensor_parallel", 2, parent="baseline", note="tensor parallel on the baseline"
        )
        b.step("max-seqs-4", "batch_policy", 4, parent="baseline", note="at most 4 sequences per step")
    b.step(
        "static-batching",
        "batching",
        "static",
        parent="baseline",
        note="static batches: requests wait for a full batch, which runs to its longest member",
        single_buckets=light,
    )
    b.step(
        "smaller-model",
        "model",
        DRAFT_MODEL_DIR,
        parent="baseline",
        note="right-sizing: the family's smaller model (the draft) served instead",
        single_buckets=light,
    )
    if full:
        # Finding J reads only the agent workload, which this step and the baseline run besides the buckets.
        b.step("no-jump-forward", "structured", False, parent="baseline", single_buckets=(),
               note="structured output without jump-forward: every forced token decoded one pass each")
    return b


def default_plan() -> Plan:
    """The short plan: every finding one machine can test, meant to take under 6 minutes of study time for a fresh
    clone on the bundled model (2 quiet cores, kernels built; 12.8 minutes measured on cores shared
    with two other sessions at load 13-33, ~5.7 scaled to quiet ones: docs/study.md). The reference progression,
    then prefix caching off, static batches and the smaller model, each from the baseline; 4 prompts per bucket
    (with 2, single slow requests flipped findings between runs), output lengths halved (the 1:4 ratio of medium
    to decode kept), concurrency 1, 4, 16, one warm-up request, and speculation's exactness checked where a step
    changes speculation (see Plan.exactness).

    Trimmed to fit the three steps added for findings B, R and prefix caching (13 configurations where 10 took
    5.0-5.7 minutes): champion-tp2, champion-dp2, no-prefix-cache, static-batching and smaller-model run their
    concurrency-1 pass over the sweep bucket only (Step.single_buckets = ()), not over short, long and decode.
    Their findings read nothing else (4 and 4b: the sweep bucket's c=1 latency and decode rate and the output
    under load; B: the sweep; R: the sweep bucket's decode rate and fidelity; prefix caching: the sweep, whose
    prompts repeat), and the decode bucket's 4 x 512 tokens at c=1 was the largest share of each step's time
    (TP=2, at 69 s the dearest step, most of all). The progression's precision and speculation steps keep every
    bucket: finding 3 reads the decode bucket, and acceptance differs by bucket. Not trimmed: fidelity (R is judged
    on it; 4 prompts x 64 tokens, ~4.5 s a step over HTTP), the sweep levels (B and 4b read c=16)."""
    b = _reference_steps(PlanBuilder(note="bfloat16 weights and KV cache"), full=False)
    return Plan(
        "default",
        b.steps,
        num_prompts=4,
        output_scale=0.5,
        concurrency=[1, 4, 16],
        sweep_rounds=1,
        warmup=1,
        exactness="speculation",
    )


def full_plan() -> Plan:
    """--full: every lever, the whole prompt set at the reference's lengths, concurrency 1..16."""
    b = _reference_steps(PlanBuilder(note="bfloat16 weights and KV cache"), full=True)
    return Plan(
        "full",
        b.steps,
        num_prompts=None,
        output_scale=1.0,
        concurrency=[1, 2, 4, 8, 16],
        sweep_rounds=2,
        fidelity_prompts=16,
        fidelity_tokens=128,
    )
