"""`leverlab train-eagle`: train an EAGLE head for a served target model folder.

Stages, all resumable from --work-dir (rerun the same command to continue):
  1. generate  the target continues prompts (bundled corpus, or --prompts FILE); the token streams are saved
  2. train     the head (leverlab/train/eagle_ttt.py loss) in the shared time-budgeted loop (trainer.py),
               checkpointing ckpt.pt every few minutes; the head folder is rewritten at each checkpoint
  3. card      acceptance and single-stream speed on held-out prompts through the engine; README.md
  4. export    the head in the `speculators` format under <out>/speculators (what vLLM loads as eagle3);
               `--export-only` re-exports an existing head without training
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model folder (default: the bundled model)")
    p.add_argument("--out", type=Path, default=None,
                   help="head folder to write (default for the bundled model: models/leverlab-code-eagle)")
    p.add_argument("--work-dir", type=Path, default=None, help="generated data, checkpoints, logs "
                   "(default .cache/train/eagle-<out name>)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="prompt file (one per line, or .jsonl with prompt/text); default: the bundled corpus")
    p.add_argument("--time-budget-min", type=float, default=30.0, help="training time, minutes")
    p.add_argument("--max-steps", type=int, default=0,
                   help="train exactly this many steps instead of for --time-budget-min (0: the time budget)")
    p.add_argument("--gen-minutes", type=float, default=10.0, help="data generation time cap, minutes")
    p.add_argument("--num-prompts", type=int, default=4000, help="training prompts to continue (at most)")
    p.add_argument("--gen-tokens", type=int, default=192, help="tokens the target generates per prompt")
    p.add_argument("--gen-temperature", type=float, default=0.8, help="for the sampled half of the prompts")
    p.add_argument("--aux-layers", default=None, help="target layers feeding the head, e.g. 1,4,7 "
                   "(default: a low, the middle and the top layer)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft positions unrolled in training")
    p.add_argument("--loss-frac", type=float, default=0.5,
                   help="share of rows scored per step (the shared lm_head dominates the cost)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype for generation and features")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the card's figures")
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="drafts per step for the card's figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--speculators-out", type=Path, default=None,
                   help="where to write the speculators-format export (default <out>/speculators)")
    p.add_argument("--export-only", action="store_true",
                   help="only export the existing head folder --out to the speculators format, then stop")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from leverlab import env
    from leverlab.config import default_model_path
    from leverlab.models.config import ModelConfig
    from leverlab.models.loader import load_model
    from leverlab.speculative.eagle_head import EagleConfig, EagleHead, init_head, save_head
    from leverlab.train.eagle_card import measure, write_card
    from leverlab.train.eagle_data import TargetFeatures, corpus_prompts, file_prompts, generate_stream
    from leverlab.train.eagle_ttt import expected_accepted, ttt_forward
    from leverlab.train.paths import MODELS_DIR, REPO_ROOT
    from leverlab.train.trainer import TrainSettings, autocast, train

    if args.max_steps < 0:
        print(f"train-eagle: --max-steps must be 0 or more, got {args.max_steps}", file=sys.stderr)
        return 2
    target = str(Path(args.model).resolve()) if args.model else str(default_model_path())
    if args.out is None:
        if args.model:
            print("train-eagle: --out is required with --model", file=sys.stderr)
            return 2
        args.out = MODELS_DIR / "leverlab-code-eagle"
    out = args.out.resolve()
    if args.export_only:
        return _export(out, target, args)
    work = (args.work_dir or REPO_ROOT / ".cache" / "train" / f"eagle-{out.name}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        for f in ("ckpt.pt", "gen_train.npy", "gen_train.json", "gen_val.npy", "gen_val.json", "log.jsonl"):
            (work / f).unlink(missing_ok=True)
    torch.set_num_threads(args.threads)
    tcfg = ModelConfig.from_folder(target)
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
    cfg = EagleConfig.for_target(tcfg, aux)
    cfg_file = work / "head_config.json"
    if cfg_file.exists() and (work / "ckpt.pt").exists():
        saved = json.loads(cfg_file.read_text())
        if saved["aux_layer_ids"] != list(cfg.aux_layer_ids):
            print(f"train-eagle: {work} holds a run with aux layers {saved['aux_layer_ids']}; use --no-resume "
                  "or another --work-dir", file=sys.stderr)
            return 2
    cfg_file.write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    print(f"target {target}: {tcfg.num_layers} layers, hidden {tcfg.hidden_size}; head aux layers "
          f"{cfg.aux_layer_ids}; work dir {work}; head -> {out}", flush=True)

    # ---- 1. data: the target's own continuations ----------------------------------------------------
    tok = AutoTokenizer.from_pretrained(target)
    eos = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else (tok.eos_token_id or 0)
    n_val = max(8, min(96, args.num_prompts // 16))  # 16 validation windows need only ~5k tokens
    if args.prompts:
        allp = file_prompts(tok, args.prompts)
        random.Random(args.seed).shuffle(allp)
        n_held = min(args.eval_prompts, max(1, len(allp) // 20))
        n_val = min(n_val, max(1, len(allp) // 20))
        held, val_p, train_p = allp[:n_held], allp[n_held:n_held + n_val], allp[n_held + n_val:]
        train_p, source = train_p[: args.num_prompts], str(args.prompts)
    else:
        train_p = corpus_prompts(tok, "train", args.num_prompts, args.seed)
        val_p = corpus_prompts(tok, "val", n_val, args.seed + 1)
        held = corpus_prompts(tok, "heldout", args.eval_prompts, args.seed + 2, min_len=32, max_len=128)
        source = "the bundled corpus (stdlib train split; val split for validation, heldout for figures)"
    gen = dict(max_tokens=args.gen_tokens, temperature=args.gen_temperature, eos_id=eos, dtype=args.dtype,
               threads=args.threads, seed=args.seed)
    train_stream = generate_stream(target, train_p, work / "gen_train.npy", minutes=args.gen_minutes, **gen)
    val_stream = generate_stream(target, val_p, work / "gen_val.npy", minutes=max(0.5, args.gen_minutes / 8), **gen)
    gen_state = json.loads((work / "gen_train.json").read_text())

    # ---- 2. train ----------------------------------------------------------------------------------
    device = env.pick_device(args.device)
    tmodel = load_model(target, args.dtype, device)
    for p in tmodel.parameters():
        p.requires_grad_(False)
    features = TargetFeatures(tmodel, cfg.aux_layer_ids)
    torch.manual_seed(args.seed)
    head = init_head(EagleHead(cfg), seed=args.seed)
    for p in head.parameters():
        p.requires_grad_(True)
    gen_rng = torch.Generator().manual_seed(args.seed)

    def loss_fn(model, x):
        with autocast(x.device):
            return ttt_forward(model, tmodel, features, x, args.ttt_steps, loss_frac=args.loss_frac,
                               generator=gen_rng)

    val_accs: list[float] = []

    @torch.no_grad()
    def evaluate(model, windows, dev) -> float:
        total, accs = 0.0, None
        for i in range(0, len(windows), args.batch_size):
            x = torch.from_numpy(windows[i : i + args.batch_size]).to(dev)
            with autocast(dev):
                loss, st = ttt_forward(model, tmodel, features, x, args.ttt_steps)
            total += loss.item()
            a = [st[f"acc_{j}"] for j in range(args.ttt_steps) if f"acc_{j}" in st]
            accs = a if accs is None else [u + v for u, v in zip(accs, a)]
        n = -(-len(windows) // args.batch_size)
        val_accs[:] = [a / n for a in accs or []]
        print("[val] top-1 agreement per draft position: " + " / ".join(f"{a:.1%}" for a in val_accs)
              + f"; ~{expected_accepted(val_accs):.2f} drafts accepted per step", flush=True)
        return total / n

    def export() -> None:
        save_head(head, out, dtype="bfloat16")

    settings = TrainSettings(time_budget_min=args.time_budget_min, max_steps=args.max_steps,
                             batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=30,
                             weight_decay=0.0, threads=args.threads, device=args.device,
                             ckpt_minutes=args.ckpt_minutes, val_windows=16, seed=args.seed, log_every=5)
    t0 = time.monotonic()
    state = train(head, loss_fn, train_stream, val_stream, work, settings, resume=args.resume,
                  on_checkpoint=export, evaluate=evaluate)
    print(f"trained in {time.monotonic() - t0:.0f} s this session; head written to {out}", flush=True)

    # ---- 3. figures and card -----------------------------------------------------------------------
    measured = measure(target, str(out), held, args.k, args.eval_tokens, args.dtype, args.threads) if held else {}
    if measured:
        print(f"held-out acceptance {measured['acceptance']:.1%} at K={args.k}, per position "
              + " / ".join(f"{r:.0%}" for r in measured["per_position"])
              + f"; single-stream speedup {measured.get('speedup', 0):.2f}x", flush=True)
    info = {
        "target": str(Path(args.model)) if args.model else "models/leverlab-code-15m",
        "target_name": Path(target).name, "out": _rel(out, REPO_ROOT), "config": cfg.to_json(),
        "params": sum(p.numel() for p in head.parameters()),
        "measured": measured,
        "training": {"train_tokens": int(np.size(train_stream)), "val_tokens": int(np.size(val_stream)),
                     "gen_prompts": gen_state["prompts_done"], "prompt_source": source,
                     "gen_temperature": args.gen_temperature, "ttt_steps": args.ttt_steps,
                     "steps": state["step"], "tokens": state["tokens"], "minutes": state["elapsed_s"] / 60,
                     "val_loss": state["val_loss"], "val_acc": val_accs},
        "command": "leverlab train-eagle " + " ".join(shlex.quote(a) for a in _cli_args()),
    }
    write_card(out, info)
    print(f"model card: {out / 'README.md'}", flush=True)
    return _export(out, target, args)


def _export(out: Path, target: str, args: argparse.Namespace) -> int:
    """The head in the speculators format (vLLM: --speculative-config '{"method": "eagle3", "model": DIR}')."""
    import torch

    from leverlab.models.config import ModelConfig
    from leverlab.speculative.eagle3_format import export_speculators, load_head, vllm_problems

    if not (out / "config.json").is_file():
        print(f"train-eagle: no head in {out} to export", file=sys.stderr)
        return 2
    head = load_head(out, torch.float32)
    dest = export_speculators(head, args.speculators_out or out / "speculators", target, args.k,
                              dtype=head.config.dtype)
    print(f"speculators export: {dest}", flush=True)
    for why in vllm_problems(head.config, ModelConfig.from_folder(target).num_layers):
        print(f"note: vLLM cannot run this export as it is: {why}", flush=True)
    return 0


def _cli_args() -> list[str]:
    """This run's flags as typed (for the card's reproduce line), when run from the command line."""
    return sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "train-eagle" else []


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)
