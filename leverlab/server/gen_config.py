"""`--generation-config`: default sampling parameters from the model's generation_config.json, as vLLM does.

    auto    (default, as in vLLM) the model folder's generation_config.json, when it has one
    vllm    none: the OpenAI defaults (temperature 1, top_p 1, no top_k)
    FOLDER  the generation_config.json in that folder

A default applies only where the request leaves the field out (or sends null). The fields read are vLLM's
(ModelConfig.get_diff_sampling_param): temperature, top_p, top_k, min_p, repetition_penalty,
presence_penalty, frequency_penalty. `do_sample` is not read (vLLM does not read it either: a model that
ships `do_sample: false` and a temperature still samples at that temperature). `max_new_tokens` caps
max_tokens where the request leaves it to the context's room (chat without max_tokens, or null), as vLLM's
get_max_tokens does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("leverlab.server")

_APPLIED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens: the cap where a request leaves max_tokens open
    source: str | None = None

    @classmethod
    def from_model(cls, model_path: str | None, mode: str | None) -> SamplingDefaults:
        mode = mode or "auto"
        if mode == "vllm":
            return cls()
        folder = Path(model_path) if mode == "auto" else Path(mode)
        if mode != "auto" and not folder.is_dir():
            raise ValueError(f"--generation-config {mode!r}: not 'auto', 'vllm' or a folder")
        path = folder / "generation_config.json" if model_path or mode != "auto" else None
        if path is None or not path.is_file():
            if mode != "auto":
                raise ValueError(f"--generation-config: no generation_config.json in {folder}")
            return cls()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--generation-config: cannot read {path}: {e}") from e
        found = {k: data[k] for k in _APPLIED if isinstance(data.get(k), (int, float)) and not isinstance(data[k], bool)}
        if "top_k" in found:
            found["top_k"] = int(found["top_k"])
        new = data.get("max_new_tokens")
        if isinstance(new, int) and not isinstance(new, bool) and new > 0:
            found["max_tokens"] = new
        if found:
            log.info("sampling defaults from %s: %s (--generation-config vllm to ignore them)", path, found)
        return cls(**found, source=str(path))

    def apply(self, req: Any) -> None:
        """Fill the request's unset sampling fields (None) with these defaults."""
        for name in _APPLIED:
            value = getattr(self, name)
            if value is not None and getattr(req, name, None) is None:
                setattr(req, name, value)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*_APPLIED, "max_tokens") if getattr(self, k) is not None}
