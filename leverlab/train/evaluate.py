"""Evaluation of the exported models for their cards: validation loss/perplexity, the draft's top-1 agreement
with the target, and greedy continuations of held-out function headers checked with the `tokenize` module.
"""

from __future__ import annotations

import io
import math
import random
import tokenize

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from leverlab.train.chat_data import iter_functions
from leverlab.train.corpus import load_splits
from leverlab.train.data import fixed_windows, load_tokens
from leverlab.train.model_configs import EOT_ID, IM_END_ID
from leverlab.train.paths import Paths
from leverlab.train.tokenizer import load_tokenizer

EVAL_WINDOWS = 64  # x 513 tokens of the validation split, evenly spaced
SEQ_LEN = 512


def load_exported(path) -> Qwen3ForCausalLM:
    # Exported weights are bf16; computing in fp32 from them measures exactly what is shipped.
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def val_metrics(target, draft, windows: np.ndarray, batch: int = 8) -> dict:
    """Validation CE of both models and the draft's top-1 agreement with the target, same positions."""
    tot_t = tot_d = agree = n = 0.0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(windows[i : i + batch])
        inp, tgt = x[:, :-1], x[:, 1:].flatten()
        lt = target(input_ids=inp).logits.flatten(0, 1)
        tot_t += F.cross_entropy(lt, tgt, reduction="sum").item()
        if draft is not None:
            ld = draft(input_ids=inp).logits.flatten(0, 1)
            tot_d += F.cross_entropy(ld, tgt, reduction="sum").item()
            agree += (ld.argmax(-1) == lt.argmax(-1)).sum().item()
        n += tgt.numel()
    out = {"target_val_loss": tot_t / n, "target_val_ppl": math.exp(tot_t / n), "val_tokens": int(n)}
    if draft is not None:
        out |= {
            "draft_val_loss": tot_d / n,
            "draft_val_ppl": math.exp(tot_d / n),
            "draft_top1_agreement": agree / n,
        }
    return out


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int, stop: tuple[int, ...] = (EOT_ID, IM_END_ID)) -> list[int]:
    """Plain greedy decoding with the KV cache of `transformers` (evaluation only; not the engine)."""
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=list(stop),
        pad_token_id=EOT_ID,
    )
    new = out[0, len(ids) :].tolist()
    return [t for t in new if t not in stop]


def tokenizes_as_python(text: str) -> bool:
    """True when `tokenize` reads the text (cut back to its last complete line) without an error."""
    cut = text[: text.rfind("\n") + 1] if "\n" in text else text
    try:
        for _ in tokenize.generate_tokens(io.StringIO(cut).readline):
            pass
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return False
    return True


def header_continuations(paths: Paths, target, draft, tok, count: int = 64, max_new: int = 64, seed: int = 0):
    """Greedy 64-token continuations of held-out function headers (`def name(args):`, dedented)."""
    funcs = [fi for f in load_splits()["heldout"] for fi in iter_functions(f, max_lines=200)]
    rng = random.Random(f"{seed}-headers")
    rng.shuffle(funcs)
    seen, samples = set(), []
    for fi in funcs:
        if len(samples) >= count:
            break
        if fi.signature in seen:
            continue
        seen.add(fi.signature)
        # No trailing newline: the byte-level pre-tokenizer merges "\n" with the next line's indentation, so a
        # prompt ending in a bare "\n" puts the model on a token boundary it never saw before an indented line.
        prompt = fi.signature
        ids = tok.encode(prompt, add_special_tokens=False).ids
        new = greedy(target, ids, max_new)
        text = tok.decode(new, skip_special_tokens=True)
        rec = {
            "source": fi.rel,
            "prompt": prompt,
            "continuation": text,
            "new_tokens": len(new),
            "valid_python": tokenizes_as_python(prompt + text),
        }
        if draft is not None and new:
            # How often the draft's argmax equals the target's greedy token along the target's own path: the
            # acceptance a speculative decoder would see (greedy verification).
            full = torch.tensor([ids + new])
            pred = draft(input_ids=full).logits[0, len(ids) - 1 : -1].argmax(-1)
            rec["draft_agree"] = (pred == full[0, len(ids) :]).float().mean().item()
        samples.append(rec)
    return samples


def chat_samples(model, tok, workload: dict, count: int = 4, max_new: int = 96) -> list[dict]:
    from leverlab.train.tokenizer import render_chat

    out = []
    for item in workload.get("chat", [])[:count]:
        prompt = render_chat(item["messages"], add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False).ids
        new = greedy(model, ids, max_new)
        out.append(
            {
                "id": item["id"],
                "kind": item["kind"],
                "request": item["messages"][-1]["content"],
                "response": tok.decode(new, skip_special_tokens=True),
            }
        )
    return out


def evaluate_all(paths: Paths, workload: dict | None = None, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    tok = load_tokenizer(paths.target_out)
    target = load_exported(paths.target_out)
    draft = load_exported(paths.draft_out) if (paths.draft_out / "model.safetensors").exists() else None
    windows = fixed_windows(load_tokens(paths.data, "val"), EVAL_WINDOWS, SEQ_LEN + 1)
    res = val_metrics(target, draft, windows)
    samples = header_continuations(paths, target, draft, tok)
    res["header_samples"] = samples
    res["valid_python_share"] = sum(s["valid_python"] for s in samples) / max(1, len(samples))
    full = [s for s in samples if s["new_tokens"] == 64]
    res["valid_python_share_full64"] = sum(s["valid_python"] for s in full) / max(1, len(full))
    res["num_full64"] = len(full)
    if draft is not None:
        res["draft_agree_on_target_greedy"] = float(
            np.mean([s["draft_agree"] for s in samples if "draft_agree" in s])
        )
    if workload:
        res["chat_samples"] = chat_samples(target, tok, workload)
    return res
