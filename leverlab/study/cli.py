"""`leverlab study [MODEL]`: the one-lever-at-a-time study, end to end, with fidelity and predictions.

    leverlab study                                   # the default plan on the bundled model (~6 min, 2 cores)
    leverlab study --full                            # every lever, the whole prompt set
    leverlab study --plan my-plan.toml               # a plan file (YAML or TOML; see leverlab/study/plan.py)
    leverlab study --steps 'int8:precision=int8,ng:speculation=ngram/4@int8'
    leverlab study --resume results/study-XXXX       # skip what finished, retry what failed or was refused
    leverlab study --report-only results/study-XXXX  # rebuild report.md / report.html
    leverlab study --resume results/study-XXXX --only int8-draft   # one configuration, e.g. once its model lands
    leverlab study --engine llamacpp                 # llama.cpp (`python -m leverlab.bench.peer_llamacpp build`)
    leverlab study --engine leverlab,llamacpp,vllm   # each in OUT/<engine>/, all side by side in OUT/report.md
    leverlab study compare A B [C...] [--out DIR]    # one machine: side by side; two machines: + bandwidth ratio
Exit status: 0 when every configuration ran or was refused by the engine (reported), 1 when one failed or a
speculative configuration changed greedy tokens, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None,
        help="model folder or Hugging Face Hub id (default: the bundled default model), or `compare`"
    )
    p.add_argument("--revision", default=None, help="with a Hub id: its branch, tag or commit (default: main)")
    p.add_argument("folders", nargs="*", help="after `compare`: the two study folders A B")
    p.add_argument(
        "--engine",
        default="leverlab",
        help="leverlab (default), llamacpp or vllm; several, comma-separated, run one after the other and are "
        "compared side by side",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--plan", default=None, help="a plan file (.yaml/.yml/.toml)")
    g.add_argument("--steps", default=None, help="NAME:LEVER=VALUE[@PARENT],... after a bfloat16 baseline")
    g.add_argument("--full", action="store_true", help="the full plan (every lever, every prompt)")
    p.add_argument("--out", default=None, help="study folder (default: results/study-<timestamp>)")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue the study in DIR")
    p.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help="run only these configurations (comma-separated), e.g. with --resume",
    )
    p.add_argument("--report-only", default=None, metavar="DIR", help="rebuild the report of DIR")
    p.add_argument("--workload", default=None, help="prompt set (default: models/workload.json)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per bucket")
    p.add_argument("--buckets", default=None, help="comma-separated buckets")
    p.add_argument("--concurrency", default=None, help="sweep levels, e.g. 1,4,16")
    p.add_argument(
        "--sweep-bucket", default=None, help="the bucket of the concurrency sweep (default: medium)"
    )
    p.add_argument("--output-scale", type=float, default=None, help="output lengths x this")
    p.add_argument(
        "--execution-mode", default="eager", choices=("eager", "compiled"), help="LeverLab servers"
    )
    p.add_argument(
        "--gguf", action="append", default=[], metavar="PRECISION=FILE", help="llama.cpp model files"
    )
    p.add_argument("--draft-gguf", default=None, help="llama.cpp draft model file")
    p.add_argument("--checkpoint", "--vllm-checkpoint", dest="checkpoint", action="append", default=[],
                   metavar="PRECISION=DIR", help="a pre-quantized folder (e.g. a published compressed-tensors W8A8 "
                   "release for int8) that every engine serves for that precision")
    p.add_argument(
        "--fidelity",
        default="auto",
        choices=("auto", "inprocess", "http"),
        help="how to collect fidelity: auto = HTTP from each configuration's server (speculative LeverLab steps add a "
        "float32 exactness pair in-process); inprocess = all of it through the Python API (LeverLab only)",
    )
    p.add_argument("--bandwidth", type=float, default=None, help="GB/s (skip measuring it)")
    p.add_argument("--quiet", action="store_true", help="no per-request progress bars")
    p.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        metavar="USD",
        help="price of one device-hour: a cost column in $ per million output tokens and the cost "
        "recommendation in dollars (also with --report-only)",
    )


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise ValueError(f"{flag} takes NAME=PATH, got {it!r}")
        out[k] = v
    return out


def build_plan(args: argparse.Namespace):
    from leverlab.study import plan as P
    from leverlab.study import plan_files

    if args.plan:
        plan = plan_files.load_plan(args.plan)
    elif args.steps:
        plan = plan_files.plan_from_steps_arg(args.steps)
        short = P.default_plan()
        for k in ("num_prompts", "output_scale", "concurrency", "sweep_rounds"):
            setattr(plan, k, getattr(short, k))
    elif args.full:
        plan = P.full_plan()
    else:
        plan = P.default_plan()
    if args.num_prompts is not None:
        plan.num_prompts = args.num_prompts
    if args.buckets:
        plan.buckets = [b.strip() for b in args.buckets.split(",") if b.strip()]
        if plan.sweep_bucket not in plan.buckets:
            plan.sweep_bucket = plan.buckets[0]
    if args.sweep_bucket:
        plan.sweep_bucket = args.sweep_bucket
    if args.concurrency:
        plan.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.output_scale is not None:
        plan.output_scale = args.output_scale
    return plan


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from leverlab.study.plan import PlanError

    console = Console(stderr=True)
    if args.price_per_hour is not None and not args.price_per_hour > 0:
        print("leverlab study: --price-per-hour takes a positive number of dollars", file=sys.stderr)
        return 2
    if args.model == "compare":
        return _compare(args, console)
    if args.folders:
        print(f"leverlab study: unexpected arguments {args.folders} (one model; or `compare A B`)", file=sys.stderr)
        return 2
    if args.report_only:
        return _report(Path(args.report_only), console, args.price_per_hour)
    names = [n.strip() for n in args.engine.split(",") if n.strip()]
    try:
        plan = build_plan(args)
        engines = [_engine(n, args) for n in names]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"--engine names each engine once, got {args.engine!r}")
    except (PlanError, ValueError, OSError) as e:
        print(f"leverlab study: {e}", file=sys.stderr)
        return 2
    if len(engines) == 1:
        return _study(args, plan, engines[0], console)
    # Several engines: one study each in OUT/<engine>, on the same plan, prompts and bandwidth figure (one
    # machine: measured once) and one run id (how the report knows they share a machine), then one
    # side-by-side report of all of them in OUT.
    out = Path(args.resume or args.out or f"results/study-{time.strftime('%Y%m%d-%H%M%S')}")
    run_id = f"{out.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    rcs = []
    for e in engines:
        sub = argparse.Namespace(**vars(args))
        sub.out = str(out / e.name)
        sub.resume = str(out / e.name) if args.resume else None
        rcs.append(_study(sub, plan, e, console, run_id=run_id))
        if rcs[-1] == 2:
            return 2
        if args.bandwidth is None:
            args.bandwidth = json.loads((out / e.name / "study.json").read_text()).get("bandwidth_gbs")
    _side_by_side({e.name: out / e.name for e in engines}, out, console)
    return max(rcs)


def _side_by_side(dirs: dict[str, Path], out: Path, console) -> None:
    from rich.markup import escape

    from leverlab.study.sidebyside import write_side_by_side

    c = write_side_by_side(dirs, out)
    for f in c["lever_findings"]:
        console.print(escape("  " + f["text"].replace("**", "")))
    console.print(f"side by side: {out / 'report.md'} and {out / 'report.html'}")


def _engine(name: str, args: argparse.Namespace):
    from leverlab.study.engines import get_engine

    engine = get_engine(
        name,
        execution_mode=args.execution_mode,
        gguf=_pairs(args.gguf, "--gguf"),
        draft_gguf=args.draft_gguf,
        checkpoints=_pairs(args.checkpoint, "--checkpoint"),
    )
    if args.fidelity != "auto":
        if args.fidelity == "inprocess" and engine.name != "leverlab":
            raise ValueError("--fidelity inprocess needs the leverlab engine (it uses the Python API)")
        engine.fidelity_mode = args.fidelity
    return engine


def _compare(args: argparse.Namespace, console) -> int:
    """Folders from one machine (one `--engine a,b` run, or the same host): the engines side by side, no
    bandwidth-ratio check. Two folders from two machines: the two-machine comparison with that check."""
    if len(args.folders) < 2:
        print("leverlab study compare: give two study folders, A B (more when they come from one machine)",
              file=sys.stderr)
        return 2
    folders = [Path(f) for f in args.folders]
    for f in folders:
        if not (f / "study.json").is_file():
            print(f"leverlab study compare: {f} holds no study.json", file=sys.stderr)
            return 2
    out = Path(args.out or f"results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    from leverlab.study.sidebyside import same_machine

    states = [json.loads((f / "study.json").read_text()) for f in folders]
    if same_machine(states):
        labels = [s.get("engine") or f.name for s, f in zip(states, folders)]
        if len(set(labels)) != len(labels):  # the same engine twice (two runs): the folders tell them apart
            labels = [f"{lb} ({f.name})" for lb, f in zip(labels, folders)]
        _side_by_side(dict(zip(labels, folders)), out, console)
        return 0
    if len(folders) != 2:
        print("leverlab study compare: folders from several machines are compared two at a time, A B",
              file=sys.stderr)
        return 2
    a, b = folders
    from leverlab.study.compare import write_compare

    c = write_compare(a, b, out)
    f = c["memory_finding"]
    console.print(f"[{f['status']}] {f['title']}: {f['why']}")
    console.print(f"side by side: {out / 'report.md'} and {out / 'report.html'}")
    return 0


def _study(args: argparse.Namespace, plan, engine, console, run_id: str | None = None) -> int:
    from leverlab.config import default_model_path
    from leverlab.errors import ModelNotFound
    from leverlab.hub import resolve_model

    try:  # a Hub id: its cached snapshot folder, which every configuration's engine then loads
        model = str(args.model and resolve_model(args.model, args.revision) or default_model_path())
    except ModelNotFound as e:
        print(f"leverlab study: {e}", file=sys.stderr)
        return 1
    root = Path(__file__).resolve().parents[2]
    workload = args.workload or str(root / "models" / "workload.json")
    if not Path(workload).is_file():
        print(f"leverlab study: no prompt set at {workload} (--workload)", file=sys.stderr)
        return 2
    out = Path(args.resume or args.out or f"results/study-{time.strftime('%Y%m%d-%H%M%S')}")
    from leverlab.study.runner import run_study

    only = None
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {s.name for s in plan.steps}]
        if unknown:
            print(f"leverlab study: --only names {unknown} are not in the plan", file=sys.stderr)
            return 2
        only = lambda s: s.name in names  # noqa: E731

    console.print(
        f"[bold]leverlab study[/bold]: plan {plan.name} ({len(plan.steps)} configurations) on {model}"
    )
    console.print(f"results in {out}")
    try:
        state = run_study(
            plan,
            engine,
            model,
            out,
            source_workload=workload,
            resume=bool(args.resume),
            console=console,
            show_requests=not args.quiet,
            bandwidth_gbs=args.bandwidth,
            only=only,
            run_id=run_id,
        )
    except ValueError as e:
        print(f"leverlab study: {e}", file=sys.stderr)
        return 2
    console.print(f"study done in {state.data.get('elapsed_s', 0) / 60:.1f} min; writing the report")
    return _report(out, console, args.price_per_hour)


def _report(out: Path, console, price_per_hour: float | None = None) -> int:
    from leverlab.study.report import write_report

    if not (out / "study.json").is_file():
        # A several-engine folder: each engine's report again, then the side-by-side one.
        # In the order they ran (the invocation's engine order), which is the order of their start times.
        subs = sorted(
            (p.parent for p in out.glob("*/study.json")),
            key=lambda d: (json.loads((d / "study.json").read_text()).get("started") or "", d.name),
        )
        if not subs:
            print(f"leverlab study: {out} holds no study.json", file=sys.stderr)
            return 2
        rcs = [_report(s, console, price_per_hour) for s in subs]
        labels = [json.loads((s / "study.json").read_text()).get("engine") or s.name for s in subs]
        if len(set(labels)) != len(labels):
            labels = [s.name for s in subs]
        _side_by_side(dict(zip(labels, subs)), out, console)
        return max(rcs)
    a = write_report(out, price_per_hour)
    from rich.markup import escape

    for r in a["recommendations"]:
        console.print(escape(f"  {r['goal']}: {r['text'].replace('**', '')}"))
    for f in a["findings"]:
        console.print(escape(f"  [{f['status']}] {f['title']}"))
    console.print(f"report: {out / 'report.md'} and {out / 'report.html'}")
    bad = [c["name"] for c in a["configs"] if c["status"] == "failed" or c.get("bug")]
    if bad:
        console.print(f"[red]failed or flagged: {', '.join(bad)}[/red]")
    return 1 if bad else 0
