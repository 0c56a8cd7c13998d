"""Engine adapters for the study, by name (a registry: adding an engine is adding a file and one line)."""

from __future__ import annotations

import importlib

from leverlab.study.engines.base import Engine, ServerHandle, StartFailed

ENGINES: dict[str, tuple[str, str]] = {
    "leverlab": ("leverlab.study.engines.leverlab", "LeverLabEngine"),
    "llamacpp": ("leverlab.study.engines.llamacpp", "LlamaCppEngine"),
    "vllm": ("leverlab.study.engines.vllm", "VLLMEngine"),
}


def get_engine(name: str, **options) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; engines: {', '.join(ENGINES)}")
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)(**options)


__all__ = ["ENGINES", "Engine", "ServerHandle", "StartFailed", "get_engine"]
