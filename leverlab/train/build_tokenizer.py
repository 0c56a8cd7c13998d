"""Stage `tokenizer`: train the tokenizer on the train split only, then encode train/val into token arrays."""

from __future__ import annotations

import json

from leverlab.train.chat_data import chat_examples
from leverlab.train.corpus import load_splits, python_version
from leverlab.train.data import prepare_token_arrays
from leverlab.train.paths import Paths
from leverlab.train.tokenizer import save_hf_tokenizer, train_tokenizer


def build_tokenizer_and_data(paths: Paths) -> dict:
    splits = load_splits()
    texts = [f.text for f in splits["train"]] + chat_examples(splits["train"])
    tok = train_tokenizer(texts)
    save_hf_tokenizer(tok, paths.tokenizer)
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {paths.tokenizer}", flush=True)
    summary = prepare_token_arrays(paths.tokenizer, paths.data)
    summary["python"] = python_version()
    summary["split_files"] = {k: [f.rel for f in v] for k, v in splits.items()}
    (paths.data / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print({k: v for k, v in summary.items() if k in ("train", "val")}, flush=True)
    return summary
