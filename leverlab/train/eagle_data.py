"""Training text for an EAGLE head: the target's own continuations of prompts, and its features on them.

The head must predict what the target will say, so it learns from text the target generated (half greedy,
as greedy serving drafts, half sampled, for variety), prompts included. Prompts come from the bundled
corpus (random cuts of stdlib files: train split for training, val split for validation, heldout split
for the acceptance figures) or from any text file (one prompt per line, or a .jsonl with "prompt"/"text").

Generation is resumable: after each chunk the token stream and a small state file are saved under the run
dir, so a rerun continues where it stopped.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from leverlab.layers.attention import AttentionMetadata, forward_context


def corpus_prompts(tokenizer, split: str, count: int, seed: int, min_len: int = 16,
                   max_len: int = 256) -> list[list[int]]:
    """`count` token-id prompts cut from files of the bundled corpus split, each starting at a line start."""
    from leverlab.train.corpus import load_splits

    files = [f for f in load_splits()[split] if len(f.text) > 200]
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < count and files:
        f = rng.choice(files)
        lines = f.text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        ids = tokenizer.encode("".join(lines[start:start + 200]), add_special_tokens=False)
        n = rng.randint(min_len, max_len)
        if len(ids) >= min_len:
            out.append(ids[:n])
    return out


def file_prompts(tokenizer, path: Path, max_len: int = 512) -> list[list[int]]:
    """Prompts from a text file: one per non-empty line, or one per .jsonl record ("prompt" or "text")."""
    texts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            rec = json.loads(line)
            line = rec if isinstance(rec, str) else rec.get("prompt") or rec.get("text") or ""
        texts.append(line.replace("\\n", "\n"))
    return [ids[-max_len:] for t in texts if (ids := tokenizer.encode(t, add_special_tokens=False))]


def generate_stream(target_path: str, prompts: list[list[int]], out: Path, *, max_tokens: int,
                    minutes: float, temperature: float, eos_id: int, dtype: str, threads: int,
                    chunk: int = 64, seed: int = 0) -> np.ndarray:
    """Append prompt + continuation + eos for each prompt to the stream saved at `out` (.npy, with a
    .json state beside it) until every prompt is done or `minutes` of generation have been spent."""
    from leverlab import LLM, SamplingParams

    state_file = out.with_suffix(".json")
    state = json.loads(state_file.read_text()) if state_file.exists() else {"prompts_done": 0, "seconds": 0.0}
    tokens: list[int] = np.load(out).tolist() if out.exists() and state["prompts_done"] else []
    if state["prompts_done"] >= len(prompts) or state["seconds"] >= minutes * 60:
        return np.asarray(tokens, dtype=np.int32)
    llm = LLM(target_path, dtype=dtype, execution_mode="eager", num_threads=threads, max_num_seqs=chunk,
              enable_prefix_caching=False)
    while state["prompts_done"] < len(prompts) and state["seconds"] < minutes * 60:
        t0 = time.monotonic()
        i0 = state["prompts_done"]
        batch = prompts[i0 : i0 + chunk]
        params = [SamplingParams(temperature=0.0 if (i0 + j) % 2 == 0 else temperature, seed=seed + i0 + j,
                                 max_tokens=max_tokens) for j in range(len(batch))]
        outs = llm.generate(batch, params)
        for p, o in zip(batch, outs):
            tokens += p + list(o.outputs[0].token_ids) + [eos_id]
        state["prompts_done"] += len(batch)
        state["seconds"] += time.monotonic() - t0
        np.save(out, np.asarray(tokens, dtype=np.int32))
        state_file.write_text(json.dumps(state))
        print(f"[gen {out.stem}] {state['prompts_done']}/{len(prompts)} prompts, {len(tokens):,} tokens, "
              f"{state['seconds'] / 60:.1f} of {minutes:g} min", flush=True)
    del llm
    return np.asarray(tokens, dtype=np.int32)


class TargetFeatures:
    """The target's aux-layer outputs and logits over dense [B, N] windows, through the engine's own model
    code (so features match what the served target hands the head): a scratch paged cache, one block table
    per window."""

    def __init__(self, model, aux_layers: tuple[int, ...], block_size: int = 16):
        self.model, self.bs = model, block_size
        model.aux_layers = tuple(aux_layers)
        self.caches: list[torch.Tensor] = []
        self.shape: tuple[int, int] | None = None

    @torch.no_grad()  # not inference_mode: the outputs feed the head's autograd graph
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, N] -> (aux [B, N, A*H] in the target's dtype, logits [B, N, V] float32)."""
        b, n = ids.shape
        cfg, bs, dev = self.model.config, self.bs, ids.device
        per = -(-n // bs)
        if self.shape != (b, n):
            dtype = self.model.lm_head.weight.dtype
            self.caches = [torch.empty(2, b * per, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev)
                           for _ in range(cfg.num_layers)]
            self.shape = (b, n)
        tables = torch.arange(b * per, device=dev).view(b, per)
        slots = (tables[:, :, None] * bs + torch.arange(bs, device=dev)).view(b, -1)[:, :n].reshape(-1)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 seq_lens=torch.full((b,), n, dtype=torch.int64, device=dev),
                                 query_start_loc=torch.arange(0, b * n + 1, n, device=dev), max_query_len=n)
        positions = torch.arange(n, device=dev).repeat(b)
        with forward_context(meta, self.caches):
            hidden, aux = self.model(ids.reshape(-1), positions)
        logits = self.model.compute_logits(hidden)
        return aux.view(b, n, -1), logits.view(b, n, -1)
