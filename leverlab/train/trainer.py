"""The training loop shared by the target (next-token CE) and the draft (distillation): time-budgeted, resumable.

Run state lives in `run_dir`: ckpt.pt (model + optimizer + counters, written atomically every few minutes),
log.jsonl (one line per logged step and per validation). Rerunning with the same run_dir resumes from ckpt.pt;
the batch at step k is drawn from a generator seeded with (seed, k), so a resumed run sees the same data.
The learning rate follows a cosine over *training time* (elapsed / budget), because the budget is wall-clock:
elapsed time counts every step, validation and checkpoint (and any time the process was paused mid-step), not
the time between sessions.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from leverlab import env
from leverlab.train.data import fixed_windows, random_windows


@dataclass
class TrainSettings:
    time_budget_min: float = 95.0
    # A fixed number of steps instead of the time budget (0: none). The run is then the same on any machine at any
    # load (a seeded run draws the same batches), where a wall-clock budget trains as many steps as the machine
    # gives it: what a test needs of a trained fixture.
    max_steps: int = 0
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    ckpt_minutes: float = 5.0
    val_windows: int = 24
    threads: int = 2
    device: str = "auto"


def autocast(device: torch.device):
    # bf16 autocast on both CPU (AVX-512 BF16 on our machines) and GPU; master weights stay fp32.
    return torch.autocast(device.type, dtype=torch.bfloat16)


def lr_at(s: TrainSettings, step: int, elapsed_s: float) -> float:
    warm = min(1.0, (step + 1) / s.warmup_steps)
    progress = min(1.0, step / s.max_steps if s.max_steps else elapsed_s / (s.time_budget_min * 60))
    cos = s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return s.lr * warm * cos


@torch.no_grad()
def evaluate_loss(model, windows: np.ndarray, device: torch.device, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over fixed windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(windows[i : i + batch]).to(device)
        with autocast(device):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _log(run_dir: Path, rec: dict) -> None:
    with open(run_dir / "log.jsonl", "a") as fh:
        fh.write(json.dumps({**rec, "time": time.time()}) + "\n")


# loss_fn(model, x [B, L+1] int64 on device) -> (loss to backprop, dict of floats to log)
LossFn = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, dict]]


def train(
    model: torch.nn.Module,
    loss_fn: LossFn,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    run_dir: Path,
    s: TrainSettings,
    resume: bool = True,
    on_checkpoint: Callable[[], None] | None = None,
    evaluate: Callable[[torch.nn.Module, np.ndarray, torch.device], float] | None = None,
) -> dict:
    """`evaluate(model, val windows, device)`: the validation loss; next-token CE (evaluate_loss) unless given."""
    torch.set_num_threads(s.threads)
    device = env.pick_device(s.device)
    run_dir.mkdir(parents=True, exist_ok=True)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
    ckpt = run_dir / "ckpt.pt"
    if resume and ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        state = saved["state"]
        print(
            f"resumed from {ckpt}: step {state['step']}, {state['tokens']:,} tokens, "
            f"{state['elapsed_s'] / 60:.1f} min trained",
            flush=True,
        )
    elif ckpt.exists():
        (run_dir / "log.jsonl").unlink(missing_ok=True)
    _log(run_dir, {"event": "start", "settings": asdict(s), "device": str(device), **state})
    val_win = fixed_windows(val_tokens, s.val_windows, s.seq_len + 1)
    budget_s = s.time_budget_min * 60

    def checkpoint(final: bool = False) -> float:
        val = (evaluate or evaluate_loss)(model, val_win, device)
        rec = {"event": "val", **state, "val_loss": val, "val_ppl": math.exp(val), "final": final}
        _log(run_dir, rec)
        print(
            f"[val] step {state['step']} tokens {state['tokens']:,} val_loss {val:.4f} ppl {math.exp(val):.2f}",
            flush=True,
        )
        _save_atomic({"model": model.state_dict(), "optim": opt.state_dict(), "state": state}, ckpt)
        if on_checkpoint:
            on_checkpoint()
        return val

    last_ckpt = time.monotonic()
    t_window, tok_window, loss_window = time.monotonic(), 0, []

    def more() -> bool:
        return state["step"] < s.max_steps if s.max_steps else state["elapsed_s"] < budget_s

    while more():
        t0 = time.monotonic()
        rng = np.random.default_rng([s.seed, state["step"]])
        x = torch.from_numpy(random_windows(train_tokens, s.batch_size, s.seq_len + 1, rng)).to(device)
        lr = lr_at(s, state["step"], state["elapsed_s"])
        for g in opt.param_groups:
            g["lr"] = lr
        loss, extra = loss_fn(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip).item()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        state["step"] += 1
        state["tokens"] += s.batch_size * s.seq_len
        state["elapsed_s"] += time.monotonic() - t0
        tok_window += s.batch_size * s.seq_len
        loss_window.append(loss.item())
        if state["step"] % s.log_every == 0:
            dt = time.monotonic() - t_window
            rec = {
                "event": "train",
                **state,
                "loss": float(np.mean(loss_window)),
                "lr": lr,
                "grad_norm": gnorm,
                "tok_per_s": tok_window / dt,
                **extra,
            }
            _log(run_dir, rec)
            left = (
                f"{s.max_steps - state['step']} steps left"
                if s.max_steps
                else f"{max(0.0, budget_s - state['elapsed_s']) / 60:.1f} min left"
            )
            print(
                f"step {state['step']:6d} | loss {rec['loss']:.4f} | lr {lr:.2e} | {rec['tok_per_s']:,.0f} tok/s "
                f"| {state['tokens']:,} tokens | {left}",
                flush=True,
            )
            t_window, tok_window, loss_window = time.monotonic(), 0, []
        if time.monotonic() - last_ckpt > s.ckpt_minutes * 60:
            t_ckpt = time.monotonic()
            checkpoint()
            # The budget is wall-clock: validation and saving count, so a run ends when it was told to.
            state["elapsed_s"] += time.monotonic() - t_ckpt
            last_ckpt = time.monotonic()
            t_window, tok_window, loss_window = time.monotonic(), 0, []
    val = checkpoint(final=True)
    _log(run_dir, {"event": "done", **state, "val_loss": val})
    return {**state, "val_loss": val}


def ce_loss(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    with autocast(x.device):
        logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()), {}
