"""Stage `workload`: models/workload.json, the benchmark's bundled prompt set, built from held-out files only.

Buckets are code prefixes of an exact token count with the bundled tokenizer (re-encoding `text` gives exactly
`num_tokens` tokens); each starts at the beginning of a line, preferably a `def`/`class` line, so it reads like
the top of a real editing buffer. Chat prompts are ChatML requests built from held-out functions.
The schema is read by leverlab.bench; keep it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re

from tokenizers import Tokenizer

from leverlab.train.chat_data import FunctionInfo, explain_request, iter_functions, write_request
from leverlab.train.corpus import SourceFile, load_splits, python_version
from leverlab.train.model_configs import TARGET_NAME
from leverlab.train.paths import Paths
from leverlab.train.tokenizer import load_tokenizer

SEED = 0
# name -> (input tokens, output tokens, number of prompts)
BUCKETS = {
    "short": (64, 256, 32),
    "medium": (512, 256, 32),
    "long": (1500, 256, 24),
    "decode": (64, 1024, 32),
}
NUM_CHAT = 24
_DEF_LINE = re.compile(r"[ \t]*(?:async[ \t]+def|def|class|@)[ \t]")


def _line_start_tokens(text: str, offsets: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token indices whose token begins a line: (at a def/class/decorator line, at any line)."""
    func, other = [], []
    for i, (start, _end) in enumerate(offsets):
        if start == 0 or text[start - 1] == "\n":
            (func if _DEF_LINE.match(text, start) else other).append(i)
    return func, other


def cut_prefix(tok: Tokenizer, f: SourceFile, n: int, rng: random.Random, tries: int = 40) -> str | None:
    """A substring of `f` starting at a line start that encodes to exactly `n` tokens, or None."""
    enc = tok.encode(f.text, add_special_tokens=False)
    if len(enc.ids) < n + 8:
        return None
    func, other = _line_start_tokens(f.text, enc.offsets)
    fits = [i for i in func if i + n <= len(enc.ids)]
    rest = [i for i in other if i + n <= len(enc.ids)]
    starts = rng.sample(fits, min(len(fits), tries)) + rng.sample(rest, min(len(rest), tries))
    for i in starts:
        text = f.text[enc.offsets[i][0] : enc.offsets[i + n - 1][1]]
        # Re-encoding in isolation can merge differently at the edges; keep only exact cuts.
        if tok.encode(text, add_special_tokens=False).ids == enc.ids[i : i + n]:
            return text
    return None


def _bucket(
    tok: Tokenizer, files: list[SourceFile], name: str, n: int, out_len: int, count: int, seed: int
) -> dict:
    rng = random.Random(f"{seed}-{name}")
    order = files[:]
    rng.shuffle(order)
    prompts: list[dict] = []
    rounds = 0
    # One prompt per file first; a second pass over the files only if the bucket is still short.
    while len(prompts) < count and rounds < 3:
        for f in order:
            if len(prompts) >= count:
                break
            text = cut_prefix(tok, f, n, rng)
            if text is None or any(p["text"] == text for p in prompts):
                continue
            prompts.append(
                {"id": f"{name}-{len(prompts):03d}", "source": f.rel, "text": text, "num_tokens": n}
            )
        rounds += 1
    return {"input_tokens": n, "output_len": out_len, "prompts": prompts}


def _chat(tok: Tokenizer, files: list[SourceFile], count: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-chat")
    funcs: list[FunctionInfo] = [
        fi
        for f in files
        for fi in iter_functions(f, max_lines=25)
        if len(tok.encode(fi.source_no_doc).ids) <= 300 and len(fi.summary) < 300
    ]
    rng.shuffle(funcs)
    out, used = [], set()
    for fi in funcs:
        if len(out) >= count:
            break
        if (fi.rel, fi.name) in used:
            continue
        used.add((fi.rel, fi.name))
        kind = "explain" if len(out) % 2 == 0 else "write"
        content = explain_request(fi) if kind == "explain" else write_request(fi)
        out.append(
            {
                "id": f"chat-{len(out):03d}",
                "kind": kind,
                "source": fi.rel,
                "messages": [{"role": "user", "content": content}],
            }
        )
    return out


def build_workload(paths: Paths, seed: int = SEED) -> dict:
    tok_dir = paths.target_out if (paths.target_out / "tokenizer.json").exists() else paths.tokenizer
    tok = load_tokenizer(tok_dir)
    heldout = load_splits()["heldout"]
    workload = {
        "provenance": {
            "source": f"CPython {python_version()} stdlib, held-out split",
            "seed": seed,
            "tokenizer": TARGET_NAME,
            "created_by": "leverlab train-default --stage workload",
            "heldout_files": len(heldout),
            "tokenizer_sha256": hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest(),
        },
        "buckets": {name: _bucket(tok, heldout, name, n, o, c, seed) for name, (n, o, c) in BUCKETS.items()},
        "chat": _chat(tok, heldout, NUM_CHAT, seed),
    }
    paths.workload.parent.mkdir(parents=True, exist_ok=True)
    paths.workload.write_text(json.dumps(workload, indent=1, ensure_ascii=False) + "\n")
    sizes = {k: len(v["prompts"]) for k, v in workload["buckets"].items()}
    print(f"workload: {sizes}, chat {len(workload['chat'])} -> {paths.workload}", flush=True)
    return workload
