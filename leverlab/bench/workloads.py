"""Workloads: each builder returns {bucket name: [BenchRequest, ...]} in a deterministic, seeded order.

- buckets:       the reference design, from the bundled prompt set (models/workload.json) or any file of
                 that schema: prompts grouped by input length, a fixed output length per bucket.
- sharegpt:      a ShareGPT-format JSON file, filtered and bucketed by token length (needs a tokenizer).
- synthetic:     random- or fixed-length prompts of a given token length.
- shared-prefix: many requests behind one long common system prompt (for prefix caching).

Tokenizers are imported only here and only when a builder needs token counts (transformers is heavy).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leverlab.bench.records import BenchRequest

REFERENCE_BUCKETS = ("short", "medium", "long", "decode")
# ShareGPT bucketing: [lo, hi) prompt-token ranges, 256 output tokens; "decode" draws short prompts with a
# long output, as the reference study's real_decode bucket did.
SHAREGPT_EDGES = {"short": (4, 128), "medium": (128, 512), "long": (512, 2048), "decode": (4, 128)}
DEFAULT_OUTPUT_LEN = 256
DEFAULT_DECODE_OUTPUT_LEN = 1024


class WorkloadError(ValueError):
    pass


@dataclass(slots=True)
class Workload:
    kind: str
    buckets: dict[str, list[BenchRequest]]
    description: dict[str, Any]  # for the manifest: source, hash, per-bucket lengths


def default_workload_path() -> Path:
    import leverlab

    return Path(leverlab.__file__).resolve().parent.parent / "models" / "workload.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rng(seed: int, *parts: object) -> random.Random:
    # A stream per bucket, so adding or dropping a bucket leaves the others' draws unchanged.
    return random.Random("/".join([str(seed), *map(str, parts)]))


def take(items: Sequence[Any], n: int | None, rng: random.Random) -> list[Any]:
    """n items: a seeded sample without replacement when n <= len(items); all of them, then repeats
    in a seeded order, when more are asked for (repeats are marked by the caller's ids)."""
    items = list(items)
    if n is None:
        return items
    if n <= len(items):
        return rng.sample(items, n)
    out: list[Any] = []
    while len(out) < n:
        out.extend(rng.sample(items, len(items)))
    return out[:n]


def _describe(buckets: dict[str, list[BenchRequest]]) -> dict[str, Any]:
    desc = {}
    for name, reqs in buckets.items():
        toks = [r.prompt_tokens for r in reqs if r.prompt_tokens is not None]
        desc[name] = {
            "requests": len(reqs),
            "output_len": sorted({r.output_len for r in reqs}),
            "input_tokens_min": min(toks) if toks else None,
            "input_tokens_max": max(toks) if toks else None,
            "input_tokens_mean": (sum(toks) / len(toks)) if toks else None,
        }
    return desc


def _with_repeat_ids(reqs: list[BenchRequest]) -> list[BenchRequest]:
    seen: dict[str, int] = {}
    for r in reqs:
        k = seen.get(r.id, 0)
        seen[r.id] = k + 1
        if k:
            r.id = f"{r.id}#{k}"
    return reqs


def load_buckets(
    path: str | Path | None,
    *,
    buckets: Sequence[str] | None = None,
    num_prompts: int | None = None,
    seed: int = 0,
    output_len: int | None = None,
) -> Workload:
    """The reference design from a prompt-set file (schema: docs/bench.md). `chat` is accepted as a bucket
    name and draws the file's chat conversations (output length: output_len or 256)."""
    p = Path(path) if path else default_workload_path()
    if not p.is_file():
        raise WorkloadError(
            f"prompt set not found: {p}. The bundled set lives at models/workload.json; pass --workload-file "
            "PATH for another, or use --workload synthetic / sharegpt."
        )
    data = json.loads(p.read_text())
    file_buckets: dict[str, Any] = data.get("buckets") or {}
    names = list(buckets) if buckets else list(file_buckets)
    out: dict[str, list[BenchRequest]] = {}
    for name in names:
        if name == "chat" and "chat" not in file_buckets:
            convs = data.get("chat") or []
            if not convs:
                raise WorkloadError(f"{p} has no chat conversations")
            ol = output_len or DEFAULT_OUTPUT_LEN
            reqs = [
                BenchRequest(
                    id=c["id"], bucket="chat", output_len=ol, messages=c["messages"], source=c.get("source")
                )
                for c in take(convs, num_prompts, _rng(seed, "chat"))
            ]
        else:
            if name not in file_buckets:
                raise WorkloadError(
                    f"bucket {name!r} not in {p}; it has: {', '.join(file_buckets) or 'none'}"
                )
            b = file_buckets[name]
            ol = output_len or int(b["output_len"])
            prompts = b.get("prompts") or []
            if not prompts:
                raise WorkloadError(f"bucket {name!r} in {p} has no prompts")
            reqs = [
                BenchRequest(
                    id=q["id"],
                    bucket=name,
                    output_len=ol,
                    prompt=q["text"],
                    prompt_tokens=q.get("num_tokens"),
                    source=q.get("source"),
                )
                for q in take(prompts, num_prompts, _rng(seed, name))
            ]
        out[name] = _with_repeat_ids(reqs)
    return Workload(
        "buckets",
        out,
        {
            "kind": "buckets",
            "path": str(p),
            "sha256": file_sha256(p),
            "provenance": data.get("provenance"),
            "buckets": _describe(out),
        },
    )


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer from a local folder; never the network."""
    if not path:
        raise WorkloadError(
            "this workload needs token counts: pass --tokenizer PATH (a local tokenizer folder)"
        )
    from transformers import AutoTokenizer  # heavy; imported only when a workload needs it

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _sharegpt_turns(entry: dict[str, Any]) -> tuple[str, str] | None:
    conv = entry.get("conversations") or entry.get("conversation") or []
    if len(conv) < 2:
        return None
    first, second = conv[0], conv[1]
    if first.get("from") not in ("human", "user") or second.get("from") not in (
        "gpt",
        "assistant",
        "chatgpt",
    ):
        return None
    return first.get("value") or "", second.get("value") or ""


def load_sharegpt(
    path: str | Path,
    tokenizer,
    *,
    buckets: Sequence[str] | None = None,
    num_prompts: int | None = 16,
    seed: int = 0,
    output_len: int | None = None,
    decode_output_len: int = DEFAULT_DECODE_OUTPUT_LEN,
    edges: dict[str, tuple[int, int]] | None = None,
) -> Workload:
    """ShareGPT file -> buckets by prompt token count ([lo, hi) per bucket). The first human turn is the
    prompt; entries whose first reply is shorter than 4 tokens are dropped (vllm's filter). Entries are
    visited in a seeded shuffle and tokenized only until every bucket is full."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"dataset not found: {p}")
    edges = dict(edges or SHAREGPT_EDGES)
    names = list(buckets) if buckets else list(edges)
    unknown = [n for n in names if n not in edges]
    if unknown:
        raise WorkloadError(f"unknown ShareGPT bucket(s) {unknown}; known: {', '.join(edges)}")
    entries = json.loads(p.read_text())
    order = list(range(len(entries)))
    _rng(seed, "sharegpt").shuffle(order)
    want = num_prompts or 16
    out: dict[str, list[BenchRequest]] = {n: [] for n in names}
    scanned = 0
    for i in order:
        if all(len(v) >= want for v in out.values()):
            break
        turns = _sharegpt_turns(entries[i])
        if turns is None:
            continue
        prompt, reply = turns
        scanned += 1
        n_in = len(tokenizer(prompt, add_special_tokens=False).input_ids)
        if n_in < 4 or len(tokenizer(reply, add_special_tokens=False).input_ids) < 4:
            continue
        # One entry feeds one bucket: of the buckets its length fits and that still want prompts, the
        # emptiest (short and decode share a length range and fill alternately).
        fits = [n for n in names if edges[n][0] <= n_in < edges[n][1] and len(out[n]) < want]
        if not fits:
            continue
        name = min(fits, key=lambda n: len(out[n]))
        ol = decode_output_len if name == "decode" else (output_len or DEFAULT_OUTPUT_LEN)
        eid = str(entries[i].get("id", i))
        out[name].append(
            BenchRequest(
                id=f"{name}-{eid}",
                bucket=name,
                output_len=ol,
                prompt=prompt,
                prompt_tokens=n_in,
                source=f"sharegpt:{eid}",
            )
        )
    empty = [n for n, v in out.items() if not v]
    if empty:
        raise WorkloadError(f"no ShareGPT prompts fell in bucket(s) {empty} (edges {edges})")
    return Workload(
        "sharegpt",
        out,
        {
            "kind": "sharegpt",
            "path": str(p),
            "sha256": file_sha256(p),
            "edges": {n: edges[n] for n in names},
            "entries_scanned": scanned,
            "buckets": _describe(out),
        },
    )


# Used when no tokenizer is given: one short common word per token is close for most BPE vocabularies.
_WORDS = (
    "the of and to in is for on that with as by at from this be are it an or was can has not but "
    "all one two new more data time value list file name code line node tree type test call load"
).split()


def _text_of_len(n: int, rng: random.Random, tokenizer=None) -> tuple[str, int | None]:
    """Text of n tokens (exact with a tokenizer, up to re-tokenization at the ends; approximate without)."""
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS) for _ in range(n)), None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(min(len(tokenizer), 1 << 20)) if i not in special]
    ids = [rng.choice(vocab) for _ in range(n)]
    text = tokenizer.decode(ids)
    for _ in range(4):  # decode -> encode is not always the identity; trim or pad until it holds
        enc = tokenizer(text, add_special_tokens=False).input_ids
        if len(enc) == n:
            break
        if len(enc) > n:
            text = tokenizer.decode(enc[:n])
        else:
            text = text + tokenizer.decode([rng.choice(vocab) for _ in range(n - len(enc))])
    return text, len(tokenizer(text, add_special_tokens=False).input_ids)


def synthetic(
    *,
    input_len: int,
    output_len: int,
    num_prompts: int = 16,
    seed: int = 0,
    range_ratio: float = 0.0,
    tokenizer=None,
    bucket: str = "synthetic",
) -> Workload:
    """Random-token prompts; lengths uniform in [input_len*(1-r), input_len*(1+r)] (r=0: fixed length)."""
    if not 0 <= range_ratio < 1:
        raise WorkloadError("--range-ratio must be in [0, 1)")
    rng = _rng(seed, bucket)
    lo, hi = max(1, round(input_len * (1 - range_ratio))), max(1, round(input_len * (1 + range_ratio)))
    reqs = []
    for i in range(num_prompts):
        n = rng.randint(lo, hi)
        text, counted = _text_of_len(n, rng, tokenizer)
        reqs.append(
            BenchRequest(
                id=f"{bucket}-{i:03d}",
                bucket=bucket,
                output_len=output_len,
                prompt=text,
                prompt_tokens=counted if counted is not None else None,
                source="synthetic",
            )
        )
    out = {bucket: reqs}
    return Workload(
        "synthetic",
        out,
        {
            "kind": "synthetic",
            "input_len": input_len,
            "range_ratio": range_ratio,
            "tokenizer": tokenizer is not None,
            "buckets": _describe(out),
        },
    )


def shared_prefix(
    *,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prompts: int = 16,
    seed: int = 0,
    tokenizer=None,
    bucket: str = "shared-prefix",
) -> Workload:
    """One long common system prompt, then a distinct short question per request. The completions
    endpoint gets prefix + suffix as one prompt; chat gets a system and a user message."""
    rng = _rng(seed, bucket)
    prefix, _ = _text_of_len(prefix_len, rng, tokenizer)
    reqs = []
    for i in range(num_prompts):
        suffix, _ = _text_of_len(suffix_len, rng, tokenizer)
        suffix = f"Question {i}: {suffix}"
        prompt = prefix + "\n\n" + suffix
        # the completions prompt as sent (the chat form differs by the server's template; its usage wins)
        counted = (
            len(tokenizer(prompt, add_special_tokens=False).input_ids) if tokenizer is not None else None
        )
        reqs.append(
            BenchRequest(
                id=f"{bucket}-{i:03d}",
                bucket=bucket,
                output_len=output_len,
                prompt=prompt,
                messages=[{"role": "system", "content": prefix}, {"role": "user", "content": suffix}],
                prompt_tokens=counted,
                source="shared-prefix",
            )
        )
    out = {bucket: reqs}
    return Workload(
        "shared-prefix",
        out,
        {
            "kind": "shared-prefix",
            "prefix_len": prefix_len,
            "suffix_len": suffix_len,
            "prefix_sha256": hashlib.sha256(prefix.encode()).hexdigest(),
            "tokenizer": tokenizer is not None,
            "buckets": _describe(out),
        },
    )
