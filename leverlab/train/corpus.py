"""The corpus: the running interpreter's standard library `.py` files, deduplicated and split by file.

The split is by file (never by window), with a fixed seed, so validation windows and the held-out prompts that
the benchmark and fidelity checks use come from files the models never trained on.
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLIT_SEED = 0
VAL_FRACTION = 0.04
HELDOUT_FRACTION = 0.06


@dataclass(frozen=True, slots=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, with "/" separators, e.g. "json/decoder.py"
    text: str


def stdlib_root() -> Path:
    # sysconfig, not a hard-coded path: the corpus follows whichever interpreter runs the training.
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def load_stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """Every decodable `.py` file under the stdlib (site-packages excluded), deduplicated by content.

    Returned sorted by relative path; of duplicate contents the first path in that order is kept.
    """
    root = root or stdlib_root()
    seen: set[str] = set()
    out: list[SourceFile] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts or not path.is_file():
            continue
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are deliberately in other encodings
        if not text.strip():
            continue
        seen.add(digest)
        out.append(SourceFile(rel.as_posix(), text.replace("\r\n", "\n")))
    return out


def split_files(
    files: list[SourceFile],
    seed: int = SPLIT_SEED,
    val_fraction: float = VAL_FRACTION,
    heldout_fraction: float = HELDOUT_FRACTION,
) -> dict[str, list[SourceFile]]:
    """Split by file into train / val / heldout; deterministic for a given file list and seed."""
    order = sorted(files, key=lambda f: f.rel)
    rng = random.Random(seed)
    rng.shuffle(order)
    n_val = max(1, round(len(order) * val_fraction))
    n_held = max(1, round(len(order) * heldout_fraction))
    splits = {
        "val": order[:n_val],
        "heldout": order[n_val : n_val + n_held],
        "train": order[n_val + n_held :],
    }
    return {k: sorted(v, key=lambda f: f.rel) for k, v in splits.items()}


def load_splits(root: Path | None = None, seed: int = SPLIT_SEED) -> dict[str, list[SourceFile]]:
    return split_files(load_stdlib_files(root), seed=seed)
