"""`leverlab bench`: measure an OpenAI-compatible endpoint; `leverlab bench compare A B`: compare two results.

Flags map one to one onto BenchConfig (leverlab/bench/config.py); docs/bench.md explains the figures.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument(
        "compare",
        nargs="*",
        metavar="compare A B",
        help="compare two results folders instead of running: `leverlab bench compare A B`",
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the OpenAI-compatible API root")
    s.add_argument("--model", default=None, help="model name to request (default: first of /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as a Bearer token")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    s.add_argument("--no-metrics", action="store_true", help="do not scrape the server's Prometheus /metrics")
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload", choices=("buckets", "sharegpt", "synthetic", "shared-prefix", "agent"), default="buckets"
    )
    w.add_argument(
        "--workload-file", default=None, help="prompt-set JSON (default: the bundled models/workload.json)"
    )
    w.add_argument(
        "--buckets", type=_names, default=None, help="comma list, e.g. short,medium (default: all)"
    )
    w.add_argument("--dataset", default=None, help="ShareGPT-format JSON (workload sharegpt)")
    w.add_argument(
        "--tokenizer", default=None, help="local tokenizer folder (sharegpt; exact synthetic lengths)"
    )
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per bucket (default: all of a prompt-set bucket; 16 for generated workloads)",
    )
    w.add_argument("--output-len", type=int, default=None, help="override every bucket's output length")
    w.add_argument("--input-len", type=int, default=512, help="synthetic prompt length (tokens)")
    w.add_argument(
        "--range-ratio", type=float, default=0.0, help="synthetic: lengths vary +-ratio (0 = fixed)"
    )
    w.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix: common system prompt (tokens)"
    )
    w.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: per-request question (tokens)")
    w.add_argument(
        "--min-tokens",
        action="store_true",
        help="also send min_tokens = output length (for servers that honour it but not ignore_eos)",
    )
    w.add_argument(
        "--no-ignore-eos", action="store_true", help="let the model stop early (lengths then vary)"
    )
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    ld = p.add_argument_group("load")
    ld.add_argument(
        "--quick",
        action="store_true",
        help="a short sweep: 2 prompts per bucket, concurrency 1,2,4 with one round each, 1 warm-up "
        "(flags given explicitly still win)",
    )
    ld.add_argument(
        "--skip-single", action="store_true", help="skip the concurrency-1 pass over every bucket"
    )
    ld.add_argument(
        "--sweep-bucket", default=None, help="bucket for the sweep (default: medium, else the first)"
    )
    ld.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16], help="sweep levels; '' for none")
    ld.add_argument(
        "--sweep-rounds", type=int, default=4, help="requests per level: max(bucket size, rounds x c)"
    )
    ld.add_argument(
        "--request-rate", type=_floats, default=[], help="Poisson rates (req/s), replaces the sweep"
    )
    ld.add_argument("--max-concurrency", type=int, default=None, help="cap in flight under --request-rate")
    ld.add_argument("--warmup", type=int, default=2, help="uncounted requests sent first")
    ld.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("SLOs and output")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--slo-e2e-ms", type=float, default=None)
    o.add_argument(
        "--out",
        default=None,
        help="results folder (default: results/<UTC timestamp>); for compare: "
        "where compare-*.md/json go (default: A's folder)",
    )
    o.add_argument(
        "--all-figures", action="store_true", help="compare: print every figure, not the headline ones"
    )
    o.add_argument("--quiet", action="store_true", help="no live progress display")


QUICK = {"num_prompts": 2, "concurrency": [1, 2, 4], "sweep_rounds": 1, "warmup": 1}
# The parser's defaults for the same flags: --quick changes a setting only while it still has its default,
# so a flag given explicitly wins (works the same from the command line and from main([...])).
_DEFAULTS = {"num_prompts": None, "concurrency": [1, 2, 4, 8, 16], "sweep_rounds": 4, "warmup": 2}


def config_from_args(args: argparse.Namespace):
    from leverlab.bench.config import BenchConfig

    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == _DEFAULTS[k]:
                setattr(args, k, v)
    out = args.out or str(Path("results") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        workload=args.workload,
        workload_file=args.workload_file,
        buckets=args.buckets,
        dataset=args.dataset,
        tokenizer=args.tokenizer,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        input_len=args.input_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        single=not args.skip_single,
        sweep_bucket=args.sweep_bucket,
        concurrency=args.concurrency,
        sweep_rounds=args.sweep_rounds,
        request_rates=args.request_rate,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        min_tokens=args.min_tokens,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_e2e_ms=args.slo_e2e_ms,
        timeout_s=args.timeout,
        extra_body=args.extra_body,
        scrape_metrics=not args.no_metrics,
        out_dir=out,
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=160)
    err = Console(stderr=True)
    if args.compare:
        if len(args.compare) != 3 or args.compare[0] != "compare":
            err.print(
                "usage: leverlab bench compare RESULTS_A RESULTS_B  (got: {})".format(" ".join(args.compare))
            )
            return 2
        from leverlab.bench.compare import run_compare

        try:
            run_compare(
                args.compare[1], args.compare[2], out=args.out, all_figures=args.all_figures, console=console
            )
        except FileNotFoundError as e:
            err.print(f"[red]error:[/red] {e}")
            return 2
        return 0

    from leverlab.bench.report import render_table
    from leverlab.bench.runner import BenchError, Progress, run_benchmark
    from leverlab.bench.workloads import WorkloadError

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    if args.quiet:
        progress = Progress()
    else:
        from leverlab.bench.progress import RichProgress

        progress = RichProgress(err)
    try:
        result = run_benchmark(cfg, progress)
    except (BenchError, WorkloadError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    console.print(render_table(result))
    hl = (result.prometheus or {}).get("highlights")
    if hl:
        console.print({k: v for k, v in hl.items() if k.endswith("rate")} or hl)
    errors = sum(g["errors"] for g in result.groups)
    console.print(f"results: {result.out_dir}/ (report.md, summary.json, summary.csv, records.jsonl, plots/)")
    if errors:
        err.print(f"[yellow]{errors} request(s) failed; see report.md[/yellow]")
        return 1
    return 0
