"""Token streams for training: the corpus encoded once into uint16 arrays under the work dir.

train.npy: every train file's text followed by <|endoftext|>, with the synthesized chat examples shuffled in
between files; val.npy: the validation files the same way (no chat). Windows are drawn at random offsets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from leverlab.train.chat_data import chat_examples
from leverlab.train.corpus import load_splits
from leverlab.train.model_configs import EOT_ID
from leverlab.train.tokenizer import load_tokenizer


def prepare_token_arrays(tokenizer_dir: Path, data_dir: Path, seed: int = 0) -> dict:
    """Encode the train and val splits into data_dir/{train,val}.npy; return (and save) a summary."""
    tok = load_tokenizer(tokenizer_dir)
    splits = load_splits()
    data_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in ("train", "val"):
        docs = [f.text for f in splits[name]]
        n_code = len(docs)
        if name == "train":
            chats = chat_examples(splits["train"], seed=seed)
            docs = docs + chats
            random.Random(seed).shuffle(docs)
        encs = tok.encode_batch(docs, add_special_tokens=False)
        ids = []
        for e in encs:
            ids.extend(e.ids)
            ids.append(EOT_ID)
        arr = np.asarray(ids, dtype=np.uint16)  # vocab 8192 fits in 16 bits
        np.save(data_dir / f"{name}.npy", arr)
        summary[name] = {
            "files": n_code,
            "docs": len(docs),
            "tokens": int(arr.size),
            "chars": sum(map(len, docs)),
        }
    (data_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_tokens(data_dir: Path, name: str) -> np.ndarray:
    return np.load(data_dir / f"{name}.npy", mmap_mode="r")


def random_windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, length] windows at uniform random offsets (length includes the shifted target)."""
    starts = rng.integers(0, tokens.size - length, size=batch)
    return np.stack([np.asarray(tokens[s : s + length], dtype=np.int64) for s in starts])


def fixed_windows(tokens: np.ndarray, count: int, length: int) -> np.ndarray:
    """[count, length] evenly spaced windows: the same validation set at every evaluation and in every run."""
    starts = np.linspace(0, tokens.size - length - 1, num=count).astype(np.int64)
    return np.stack([np.asarray(tokens[s : s + length], dtype=np.int64) for s in starts])
