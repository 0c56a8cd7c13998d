"""`leverlab train-default`: reproduce the bundled model family from the running interpreter's stdlib source.

Stages (each resumable; `all` runs them in order):
  tokenizer  train the byte-level BPE tokenizer on the train split and encode train/val into token arrays
  target     train the ~15M Qwen3 target (time-budgeted, checkpoints every few minutes, resumes by default)
  draft      distill the ~1.5M draft from the target
  export     write both Hugging Face folders under models/ from the latest checkpoints (+ training curves)
  workload   build models/workload.json, the benchmark prompt set, from the held-out files
  card       evaluate both models and write their model cards (README.md)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

STAGES = ["tokenizer", "target", "draft", "export", "workload", "card"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(".cache/train"), help="checkpoints, logs, token arrays"
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="output folder (default: the repo's models/)"
    )
    parser.add_argument(
        "--time-budget-min", type=float, default=95.0, help="target training time, minutes (total)"
    )
    parser.add_argument(
        "--draft-budget-min", type=float, default=30.0, help="draft distillation time, minutes"
    )
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default 2e-3 target, 3e-3 draft)"
    )
    parser.add_argument("--ckpt-minutes", type=float, default=5.0)
    parser.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    parser.add_argument("--background", action="store_true", help="detach; log to <work-dir>/<stage>.log")


def _background(args: argparse.Namespace) -> int:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    log = args.work_dir / f"{args.stage}.log"
    argv = [a for a in sys.argv[1:] if a != "--background"]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leverlab.cli", *argv],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    (args.work_dir / f"{args.stage}.pid").write_text(f"{proc.pid}\n")
    print(f"started pid {proc.pid}; follow with: tail -f {log}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.background:
        return _background(args)
    from leverlab.train.paths import MODELS_DIR, Paths
    from leverlab.train.trainer import TrainSettings

    paths = Paths(work=args.work_dir.resolve(), models=(args.models_dir or MODELS_DIR).resolve())
    stages = STAGES if args.stage == "all" else [args.stage]
    common = dict(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        threads=args.threads,
        device=args.device,
        ckpt_minutes=args.ckpt_minutes,
    )
    for stage in stages:
        t0 = time.monotonic()
        print(f"== stage {stage} ==", flush=True)
        if stage == "tokenizer":
            from leverlab.train.build_tokenizer import build_tokenizer_and_data

            if (
                args.resume
                and (paths.data / "train.npy").exists()
                and (paths.tokenizer / "tokenizer.json").exists()
            ):
                # Retraining the tokenizer would invalidate every checkpoint: keep it unless --no-resume.
                print(
                    f"tokenizer and token arrays exist in {paths.work}; kept (--no-resume rebuilds)",
                    flush=True,
                )
            else:
                build_tokenizer_and_data(paths)
        elif stage == "target":
            from leverlab.train.train_target import train_target

            s = TrainSettings(time_budget_min=args.time_budget_min, lr=args.lr or 2e-3, **common)
            train_target(paths, s, resume=args.resume)
        elif stage == "draft":
            from leverlab.train.distill_draft import distill_draft

            s = TrainSettings(
                time_budget_min=args.draft_budget_min, lr=args.lr or 3e-3, warmup_steps=50, **common
            )
            distill_draft(paths, s, resume=args.resume, temperature=args.temperature)
        elif stage == "export":
            from leverlab.train.export import export_all

            export_all(paths)
        elif stage == "workload":
            from leverlab.train.workload import build_workload

            build_workload(paths)
        elif stage == "card":
            from leverlab.train.model_card import write_cards

            write_cards(paths)
        print(f"== stage {stage} done in {time.monotonic() - t0:.0f} s ==", flush=True)
    return 0
