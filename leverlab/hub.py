"""Model ids: `Qwen/Qwen3-0.6B` resolves to a folder in the Hugging Face cache, as vLLM and transformers do.

A path that exists is used as it is. Anything else is taken as a Hub id and handed to huggingface_hub's
snapshot_download, which finds the snapshot of `revision` (a branch, a tag or a commit hash; None: main) in the
cache and downloads what is missing when a network exists. With HF_HUB_OFFLINE set it only looks in the cache.
The environment is read at each call, not when huggingface_hub was imported, so HF_HOME, HF_HUB_CACHE and
HF_HUB_OFFLINE set by a program (or a test) before it builds an engine count.

EngineConfig resolves its model, tokenizer and draft model here once, so every later part sees a folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from leverlab.errors import ModelNotFound

# What a download fetches: configs, tokenizers and safetensors weights. PyTorch *.bin weights only when the
# repository has no safetensors (many repositories hold both: fetching both would double the download).
_CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
_SAFETENSORS = ["*.safetensors"]
_PICKLE = ["*.bin"]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    if "HF_HUB_OFFLINE" in os.environ:
        return _truthy(os.environ["HF_HUB_OFFLINE"])
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> Path:
    """The cache folder huggingface_hub uses: HF_HUB_CACHE, else $HF_HOME/hub, else its default."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _looks_local(model: str) -> bool:
    """A name that can only be a path (absolute, ./, ~, more than one slash, a Windows drive)."""
    return (model.startswith(("/", ".", "~", "\\")) or model.count("/") > 1 or (len(model) > 1 and model[1] == ":"))


def resolve_model(model: str, revision: str | None = None, what: str = "model") -> str:
    """A local folder (or file) for `model`: the path itself when it exists (or can only be a path), else the
    Hub id's snapshot in the cache (downloaded first unless offline). ModelNotFound says which id, revision and
    cache were looked in."""
    if not model or Path(model).expanduser().exists():
        # a local path has no revisions (transformers ignores them there too); EngineConfig copies made with
        # dataclasses.replace come here again with the folder already resolved
        return str(Path(model).expanduser()) if model else model
    if _looks_local(model):
        return model  # a path, never a Hub id: the part that reads it says what is missing there
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache, offline = hub_cache(), hub_offline()
    rev = revision or "main"
    where = f"{what} {model!r} (revision {rev!r}) is not a local folder"
    try:
        if offline:
            path = snapshot_download(model, revision=revision, cache_dir=cache, local_files_only=True)
        else:
            patterns = _CONFIG_AND_TOKENIZER + _SAFETENSORS
            path = snapshot_download(model, revision=revision, cache_dir=cache, allow_patterns=patterns)
            if not any(Path(path).glob("*.safetensors")):
                path = snapshot_download(model, revision=revision, cache_dir=cache, allow_patterns=patterns + _PICKLE)
    except HFValidationError as e:
        raise ModelNotFound(f"{what} {model!r}: no such file or folder, and not a Hugging Face Hub id ({e})") from e
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, network
        folder = cache / ("models--" + model.replace("/", "--"))
        if offline:
            raise ModelNotFound(
                f"{where}, and the Hugging Face cache {cache} has no snapshot of it (looked in {folder}); "
                "HF_HUB_OFFLINE is set, so nothing was downloaded. Fetch it first (`hf download "
                f"{model}{' --revision ' + revision if revision else ''}`), or point HF_HOME / HF_HUB_CACHE at the "
                "cache that holds it") from e
        raise ModelNotFound(
            f"{where}, and it could not be fetched from the Hugging Face Hub into {cache} (looked in {folder}): "
            f"{type(e).__name__}: {e}") from e
    return str(path)
