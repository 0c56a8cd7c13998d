"""Runs a study: for each configuration, start its server, wait for health, run the harness (warm-up, every
bucket at concurrency 1, the sweep), keep the counters, collect fidelity, stop it. Then the report.

Layout of a study folder:
    study.json              the state: plan, model, engine, bandwidth, and per configuration its status
                            (done | failed | unavailable), reason, log tail, timings (rewritten after each step)
    workload.json           the prompt set this study runs (a subset of the bundled one, lengths scaled)
    <config>/server.log     the server's output
    <config>/bench/         the harness's results folder (summary.json, records.jsonl, report.md, plots/)
    <config>/fidelity-samples.json
    report.md, report.html, analysis.json, plots/
Resume (`--resume DIR`): configurations already done are skipped; failed and refused ones are tried again.
Invariant: every started server is stopped (try/finally), and every configuration ends with a status.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from leverlab.bench.manifest import machine_info
from leverlab.study.engines import Engine, StartFailed
from leverlab.study.plan import Levers, Plan, Step
from leverlab.study.substitute import resolve_plan

# Kept on resume. Refusals are re-checked (cheap: most are found without starting a server), since the engine
# or its files may have changed since (a draft model that landed, a lever that got built).
FINAL = ("done",)


# ---- the workload ------------------------------------------------------------------------------------------


def prepare_workload(src: str | Path, plan: Plan, dest: Path) -> Path:
    """The study's own prompt set: the plan's buckets, num_prompts each (the first ones: deterministic), output
    lengths scaled by plan.output_scale. Written once; a resumed study reuses it so every config sees the same."""
    if dest.is_file():
        return dest
    raw = json.loads(Path(src).read_text())
    buckets = raw["buckets"]
    names = plan.buckets or list(buckets)
    missing = [b for b in names if b not in buckets]
    if missing:
        raise ValueError(f"buckets {missing} not in {src}; it has {list(buckets)}")
    out: dict[str, Any] = {
        "provenance": {**raw.get("provenance", {}), "study_subset_of": str(src)},
        "buckets": {},
    }
    for name in names:
        b = dict(buckets[name])
        if plan.num_prompts:
            b["prompts"] = b["prompts"][: plan.num_prompts]
        b["output_len"] = max(1, round(b["output_len"] * plan.output_scale))
        out["buckets"][name] = b
    if raw.get("chat"):
        out["chat"] = raw["chat"]  # the agent workload's turns (bench/agent.py)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    return dest


def fidelity_prompts(workload: Path, n: int) -> list[dict]:
    """n prompts taken round-robin over the buckets with the shortest inputs first (decode-like contexts)."""
    raw = json.loads(workload.read_text())["buckets"]
    order = sorted(raw, key=lambda b: raw[b].get("input_tokens", 0))
    pools = [list(raw[b]["prompts"]) for b in order]
    picked: list[dict] = []
    while len(picked) < n and any(pools):
        for pool in pools:
            if pool and len(picked) < n:
                p = pool.pop(0)
                picked.append({"id": p["id"], "text": p["text"]})
    return picked


# ---- state ---------------------------------------------------------------------------------------------------


class StudyState:
    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data = path, data

    @classmethod
    def load_or_new(cls, out_dir: Path, header: dict[str, Any], resume: bool) -> StudyState:
        path = out_dir / "study.json"
        if resume and path.is_file():
            data = json.loads(path.read_text())
            old, new = data.get("plan", {}).get("steps"), header["plan"]["steps"]
            if [s["name"] for s in old or []] != [s["name"] for s in new]:
                raise ValueError(
                    f"{path} holds a different plan; resume it with the same plan or use a new folder"
                )
            data.setdefault("resumed", []).append(time.strftime("%Y-%m-%dT%H:%M:%S"))
            data["plan"] = header["plan"]  # same steps; settings such as a draft folder may have been fixed
            for k in ("host", "run_id"):  # a folder from before they were recorded
                data.setdefault(k, header[k])
            return cls(path, data)
        return cls(path, {**header, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "configs": {}})

    def config(self, name: str) -> dict[str, Any]:
        return self.data["configs"].setdefault(name, {"status": "pending"})

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


# ---- progress ------------------------------------------------------------------------------------------------


class StudyProgress:
    """Which configuration (i/N), what it changes, how long so far and about how long is left."""

    def __init__(self, console=None, show_requests: bool = True):
        self.console = console
        self.show_requests = show_requests
        self.t0 = time.monotonic()
        self.durations: list[float] = []

    def say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg)

    def config_start(self, i: int, n: int, step: Step, remaining_runnable: int) -> None:
        elapsed = time.monotonic() - self.t0
        eta = ""
        if self.durations:
            left = sum(self.durations) / len(self.durations) * remaining_runnable
            eta = f", about {_mmss(left)} left"
        self.say(
            f"[bold cyan][{i}/{n}] {step.name}[/bold cyan] ({step.change}"
            f"{' vs ' + step.parent if step.parent else ''}) - elapsed {_mmss(elapsed)}{eta}"
        )

    def bench_progress(self):
        if self.console is None or not self.show_requests:
            return None
        from leverlab.bench.progress import RichProgress

        return RichProgress(self.console)


def _mmss(s: float) -> str:
    return f"{int(s // 60)}:{int(s % 60):02d}"


# ---- one configuration ---------------------------------------------------------------------------------------


AGENT_PROMPTS = 8  # agent-workload requests per configuration (concurrency 1, and the sweep's levels)


def run_config(
    step: Step,
    plan: Plan,
    engine: Engine,
    model: str,
    workload: Path,
    cfg_dir: Path,
    rec: dict[str, Any],
    progress: StudyProgress,
    fid_prompts: list[dict],
) -> None:
    """Fills rec (the config's entry in study.json): status, reason, timings, paths."""
    from leverlab.bench import BenchConfig, run_benchmark

    t0 = time.monotonic()
    rec.update(
        status="running", levers=asdict(step.levers), started=time.strftime("%H:%M:%S"), load_start=_load()
    )
    for k in ("reason", "log_tail", "fidelity", "fidelity_error"):
        rec.pop(k, None)
    try:
        handle = engine.start(model, step.levers, cfg_dir / "server.log")
    except StartFailed as e:
        rec.update(status=e.kind, reason=e.reason, log_tail=e.log_tail[-3000:])
        progress.say(f"  [yellow]{e.kind}[/yellow]: {e.reason}")
        return
    rec["startup_s"] = handle.startup_s
    rec["server_command"] = handle.command
    progress.say(f"  server up in {handle.startup_s:.1f} s; benchmarking")
    fid: dict[str, Any] | None = None
    try:
        bench_cfg = BenchConfig(
            base_url=handle.base_url,
            workload_file=str(workload),
            buckets=single_pass_buckets(step, plan, list(json.loads(workload.read_text())["buckets"])),
            concurrency=list(plan.concurrency),
            sweep_bucket=plan.sweep_bucket,
            sweep_rounds=plan.sweep_rounds,
            warmup=plan.warmup,
            extra_body=engine.extra_body(step.levers),
            batching=step.levers.batching,
            out_dir=str(cfg_dir / "bench"),
        )
        res = run_benchmark(bench_cfg, progress.bench_progress())
        errors = sum(g["errors"] for g in res.groups)
        completed = sum(g["completed"] for g in res.groups)
        rec.update(bench_dir="bench", requests_completed=completed, request_errors=errors)
        if plan.runs_agent(step) and engine.name == "leverlab":
            # Finding J: tool calls and JSON schemas (bench/agent.py); other engines need other server flags
            # for tools (vLLM: --tool-call-parser), so only ours runs it.
            progress.say("  agent workload (tool calls, JSON schemas)")
            agent = run_benchmark(replace(bench_cfg, workload="agent", endpoint="chat", buckets=None,
                                          num_prompts=AGENT_PROMPTS, sweep_bucket="agent",
                                          out_dir=str(cfg_dir / "bench-agent")), progress.bench_progress())
            rec.update(agent_bench_dir="bench-agent", agent_errors=sum(g["errors"] for g in agent.groups))
        if engine.fidelity_mode == "http":
            fid = _fidelity_http(engine, handle.base_url, step, plan, fid_prompts, cfg_dir, rec)
    except Exception as e:  # noqa: BLE001 - any failure is recorded with its reason, never dropped
        rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
    finally:
        rc = handle.stop()
        rec["server_exit_code"] = rc
    if rec["status"] == "failed":
        rec["log_tail"] = _tail(cfg_dir / "server.log")
        rec["duration_s"] = time.monotonic() - t0
        progress.say(f"  [red]failed[/red]: {rec['reason']}")
        return
    if rec.get("requests_completed", 0) == 0:
        rec.update(status="failed", reason=f"every request failed ({rec.get('request_errors')} errors)")
        rec["log_tail"] = _tail(cfg_dir / "server.log")
    else:
        rec["status"] = "done"
    # In-process: the whole fidelity pass (--fidelity inprocess), its own float32 exactness pair included. With
    # HTTP fidelity a speculative step's pair runs after the last server (exactness_pass).
    if engine.fidelity_mode == "inprocess" and rec["status"] == "done":
        progress.say("  fidelity pass (in-process)")
        try:
            from leverlab.study.fidelity import collect_inprocess

            fid = collect_inprocess(
                engine.weights(model, step.levers),
                asdict(step.levers),
                fid_prompts,
                plan.fidelity_tokens,
                cfg_dir,
                exactness=plan.checks_exactness(step),
            )
            rec["fidelity_source"] = fid.get("source")
        except Exception as e:  # noqa: BLE001
            rec["fidelity_error"] = str(e)[-2000:]
            progress.say(f"  [red]fidelity failed[/red]: {str(e).splitlines()[0]}")
    if fid is not None:
        (cfg_dir / "fidelity-samples.json").write_text(json.dumps(fid))
        _say_exactness(progress, fid.get("exactness"))
    rec["duration_s"] = time.monotonic() - t0
    rec["load_end"] = _load()
    progress.say(f"  {rec['status']} in {_mmss(rec['duration_s'])}")


def _say_exactness(progress: StudyProgress, ex: dict | None, name: str = "") -> None:
    if ex is not None and not ex["exact"]:
        progress.say(f"  [bold red]BUG[/bold red]: {name + ': ' if name else ''}speculation changed greedy tokens "
                     f"({ex['share_identical']:.0%} identical)")


def exactness_pass(steps: list[Step], plan: Plan, engine: Engine, model: str, out_dir: Path, state: StudyState,
                   progress: StudyProgress, fid_prompts: list[dict]) -> None:
    """The float32 spec-on/spec-off pair of every measured speculative step whose fidelity came over HTTP and
    has no exactness yet (a resumed study's too), all in one worker process (fidelity.collect_exactness)."""
    if not engine.inprocess_exactness or engine.fidelity_mode != "http":
        return
    from leverlab.study.fidelity import collect_exactness

    todo = {}
    for step in steps:
        path = out_dir / step.name / "fidelity-samples.json"
        if (state.config(step.name).get("status") == "done" and step.levers.speculative is not None
                and plan.checks_exactness(step) and path.is_file()
                and "exactness" not in json.loads(path.read_text())):
            todo[step.name] = {"name": step.name, "model": engine.weights(model, step.levers),
                               "levers": asdict(step.levers), "prompts": fid_prompts, "tokens": plan.fidelity_tokens}
    if not todo:
        return
    progress.say(f"exactness of speculation (float32, on against off, in-process): {', '.join(todo)}")
    t0 = time.monotonic()
    try:
        got = collect_exactness(list(todo.values()), out_dir / "exactness")
    except Exception as e:  # noqa: BLE001 - recorded per configuration, never dropped
        got = {name: {"error": str(e)[-2000:]} for name in todo}
    for name in todo:
        rec, res = state.config(name), got.get(name) or {"error": "no result from the exactness worker"}
        if "error" in res:
            rec["fidelity_error"] = f"exactness: {res['error']}"
            progress.say(f"  [red]exactness failed[/red] ({name}): {res['error'].splitlines()[0]}")
            continue
        path = out_dir / name / "fidelity-samples.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "exactness": res["exactness"]}))
        _say_exactness(progress, res["exactness"], name)
    state.data["exactness_s"] = time.monotonic() - t0
    state.save()


def _fidelity_http(engine, base_url, step, plan, prompts, cfg_dir, rec) -> dict[str, Any] | None:
    from leverlab.study.fidelity import collect_http

    try:
        fid = collect_http(base_url, None, prompts, plan.fidelity_tokens, engine.extra_body(step.levers))
        rec["fidelity_source"] = fid.get("source")
        return fid
    except Exception as e:  # noqa: BLE001
        rec["fidelity_error"] = f"{type(e).__name__}: {e}"
        return None


def single_pass_buckets(step: Step, plan: Plan, have: list[str]) -> list[str] | None:
    """The workload buckets a step's harness run loads: those of its single_buckets the study's workload has
    (`--buckets` may have narrowed it) and the sweep bucket; None: all of them."""
    if step.single_buckets is None:
        return None
    return list(dict.fromkeys([*(b for b in step.single_buckets if b in have), plan.sweep_bucket]))


def _refused(state: StudyState) -> dict[str, str]:
    """Steps this engine refused (status unavailable) in this study: name -> its reason."""
    return {
        n: rec.get("reason") or "refused"
        for n, rec in state.data["configs"].items()
        if rec.get("status") == "unavailable"
    }


def _as_ran(step: Step, rec: dict[str, Any]) -> Step:
    """A step kept from an earlier run, with the levers it ran with (a substitution's, if any)."""
    sub = rec.get("substitution")
    return replace(step, levers=Levers(**sub["levers"])) if sub else step


def engine_threads(model: str, levers) -> int:
    """The thread count LeverLab's engine gives this model (leverlab/engine/llm_engine.py: one thread below
    256 MiB of weights, where fork/join per op does not pay), so the bandwidth is measured as the engine reads."""
    try:
        from leverlab.study.predict import DTYPE_BITS, ModelFacts

        weight_bytes = ModelFacts.from_folder(model).num_params * DTYPE_BITS.get(levers.dtype, 16) / 8
    except Exception:  # noqa: BLE001 - not a local HF folder (GGUF, a hub name): all cores
        return os.cpu_count() or 1
    return 1 if weight_bytes < 256 * 2**20 else (os.cpu_count() or 1)


def _load() -> float | None:
    """The 1-minute load average: how contended the machine was (a 2-core machine at 7 is noisy)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _tail(path: Path, n: int = 30) -> str:
    from leverlab.study.engines.base import tail

    return tail(path, n)[-3000:]


# ---- the study -----------------------------------------------------------------------------------------------


def run_study(
    plan: Plan,
    engine: Engine,
    model: str,
    out_dir: Path,
    *,
    source_workload: str | Path,
    resume: bool = False,
    console=None,
    show_requests: bool = True,
    bandwidth_gbs: float | None = None,
    only: Callable[[Step], bool] | None = None,
    run_id: str | None = None,
) -> StudyState:
    """run_id: shared by the studies of one `--engine a,b,...` invocation (one machine, one run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "plan": plan.to_json(),
        "model": str(model),
        "engine": engine.name,
        "engine_capabilities": engine.capabilities(),
        "engine_installed": engine.installed(),
        # Which machine and which invocation: `study compare` and the cross-engine report tell one machine
        # (engines side by side, no bandwidth-ratio check) from two (the faster-memory check) by these.
        "host": machine_info(),
        "run_id": run_id,
    }
    state = StudyState.load_or_new(out_dir, header, resume)
    workload = prepare_workload(source_workload, plan, out_dir / "workload.json")
    have = list(json.loads(workload.read_text())["buckets"])
    if plan.sweep_bucket not in have:
        raise ValueError(
            f"the sweep bucket {plan.sweep_bucket!r} is not in the workload; it has {', '.join(have)}"
        )
    state.data["workload"] = str(workload)
    progress = StudyProgress(console, show_requests)
    if state.data.get("bandwidth_gbs") is None:
        threads = engine_threads(model, plan.steps[0].levers)
        if bandwidth_gbs is None:
            from leverlab.study.bandwidth import measure_bandwidth

            progress.say(
                f"measuring memory bandwidth ({threads} thread{'s' if threads > 1 else ''}, as the engine)"
            )
            bandwidth_gbs = measure_bandwidth(threads, gib=0.5)
        state.data["bandwidth_gbs"] = bandwidth_gbs
        state.data["bandwidth_threads"] = threads
    progress.say(f"memory bandwidth {state.data['bandwidth_gbs']:.1f} GB/s")
    state.save()
    # One-time setup (kernel build, GGUF files; cached, so cheap on resume): timed apart from the study.
    t_setup = time.monotonic()
    made = engine.prepare(model, plan, workload, progress.say)
    setup_s = time.monotonic() - t_setup
    state.data["setup_s"] = state.data.get("setup_s", 0.0) + setup_s
    if made:
        state.data["engine_files"] = made
    fid_prompts = fidelity_prompts(workload, plan.fidelity_prompts)
    steps = [s for s in plan.steps if only is None or only(s)]
    ran: list[Step] = []  # the steps as they ran on this engine (a substitution's levers), for the exactness pass
    for i, step in enumerate(steps, 1):
        rec = state.config(step.name)
        # Resolved before each step: a refusal at start-up earlier in this study (status "unavailable") makes
        # the refused value one to stand in for in its descendants (leverlab/study/substitute.py).
        resolved = resolve_plan(
            plan, engine.unsupported, lambda lv: engine.runnable(model, lv), _refused(state)
        )
        run_step = replace(step, levers=resolved[step.name].levers)
        if resume and rec.get("status") in FINAL:
            progress.say(f"[{i}/{len(steps)}] {step.name}: {rec['status']} (kept from the earlier run)")
            ran.append(_as_ran(step, rec))
            continue
        remaining = sum(
            1
            for s in steps[i - 1 :]
            if state.config(s.name).get("status") not in FINAL
            and engine.runnable(model, resolved[s.name].levers)
        )
        progress.config_start(i, len(steps), step, remaining)
        sub = resolved[step.name].record(step, engine.name)
        if sub and engine.runnable(model, run_step.levers):
            progress.say(f"  on {engine.name}: {sub['label']}")
        cfg_dir = out_dir / step.name
        cfg_dir.mkdir(parents=True, exist_ok=True)
        try:
            run_config(run_step, plan, engine, model, workload, cfg_dir, rec, progress, fid_prompts)
        except KeyboardInterrupt:
            rec.update(status="failed", reason="interrupted")
            state.save()
            raise
        # Kept only where the stand-in ran: a configuration not available on this engine reads as planned.
        if sub and rec.get("status") != "unavailable":
            rec["substitution"] = sub
        else:
            rec.pop("substitution", None)
        ran.append(run_step)
        if rec.get("status") == "done":
            progress.durations.append(rec.get("duration_s", 0.0))
        state.save()
    exactness_pass(ran, plan, engine, model, out_dir, state, progress, fid_prompts)
    state.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    # Cumulative over resumed runs: the time the study's measurements took, not the last session's.
    state.data["elapsed_s"] = state.data.get("elapsed_s", 0.0) + (time.monotonic() - progress.t0 - setup_s)
    state.save()
    return state
