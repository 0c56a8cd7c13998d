"""The tokenizer of a model: from its folder, from a GGUF file's metadata, or from --tokenizer."""

from __future__ import annotations

from pathlib import Path

from leverlab.models import gguf_file


def load_tokenizer(model: str | Path, tokenizer: str | None = None):
    """transformers' tokenizer for `model`. A GGUF file's is built by transformers from the file's own vocabulary,
    merges and special ids (AutoTokenizer's gguf_file), with the chat template the file carries
    (tokenizer.chat_template); `tokenizer` (a folder) wins over either, as vLLM's --tokenizer does."""
    from transformers import AutoTokenizer

    if tokenizer:  # a folder (EngineConfig.resolve_models has turned a Hub id into its cached snapshot)
        return AutoTokenizer.from_pretrained(tokenizer)
    path = Path(model)
    if not gguf_file.is_gguf(path):
        return AutoTokenizer.from_pretrained(str(model))
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ValueError(f"GGUF {path}: transformers could not build a tokenizer from its metadata ({e}); pass "
                         "--tokenizer FOLDER (the Hugging Face folder it was converted from)") from e
    template = gguf_file.chat_template(path)
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    return tok
