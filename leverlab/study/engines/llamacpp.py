"""llama.cpp's server: a `llama-server` binary on PATH, else the `llama-cpp-python` package's server
(`python -m llama_cpp.server`). Neither is installed by default (llama-cpp-python builds from source).

llama.cpp reads GGUF files, so precision is a file, not a flag: pass one GGUF per precision
(`--gguf bfloat16=model-bf16.gguf --gguf int8=model-q8_0.gguf`); a precision without a file cannot be
expressed. Mapping:
  precision        the GGUF file (Q8_0 ~ int8, Q4_0/Q4_K ~ int4)
  kv_cache_dtype   llama-server -ctk/-ctv q8_0; llama_cpp.server --type_k/--type_v 8 (GGML_TYPE_Q8_0)
  speculation      draft_model: llama-server -md DRAFT.gguf --draft-max K; ngram: llama_cpp.server
                   --draft_model prompt-lookup-decoding --draft_model_num_pred_tokens K; eagle: none
  prefix_caching   on by default in both (per request `cache_prompt`); off: the request sends cache_prompt=false
  tensor_parallel  none on CPU (multi-GPU splits layers, not tensors: --split-mode row is the nearest)
  batch_policy     llama-server -np N (parallel slots, continuous batching); llama_cpp.server: none (one at a time)
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

from leverlab.study.engines.base import Engine
from leverlab.study.plan import Levers

GGML_TYPE_Q8_0 = 8


class LlamaCppEngine(Engine):
    name = "llamacpp"
    health_path = "/v1/models"
    fidelity_mode = "http"

    def __init__(
        self, gguf: dict[str, str] | None = None, draft_gguf: str | None = None, n_ctx: int = 4096, **_
    ):
        self.gguf = dict(gguf or {})
        self.draft_gguf = draft_gguf
        self.n_ctx = n_ctx
        self.binary = shutil.which("llama-server")
        self.module = importlib.util.find_spec("llama_cpp") is not None and not self.binary

    def installed(self) -> str | None:
        if self.binary or self.module:
            return None
        return "not installed: no `llama-server` on PATH and no `llama_cpp` module (pip install 'llama-cpp-python[server]')"

    def _model_file(self, model: str, levers: Levers) -> str | None:
        return self.gguf.get(levers.precision_label()) or (model if model.endswith(".gguf") else None)

    def unsupported(self, levers: Levers) -> dict[str, str]:
        gaps: dict[str, str] = {}
        if self._model_file("", levers) is None:
            gaps["precision"] = (
                f"no GGUF file for {levers.precision_label()} (pass --gguf {levers.precision_label()}=FILE)"
            )
        if levers.kv_cache_dtype not in ("auto", "int8"):
            gaps["kv_cache_dtype"] = (
                f"{levers.kv_cache_dtype} KV cache has no llama.cpp type (q8_0 is the int8 one)"
            )
        spec = levers.speculative or {}
        method = spec.get("method")
        if method in ("eagle", "eagle3"):
            gaps["speculation"] = "llama.cpp has no EAGLE heads"
        elif method == "ngram" and self.binary:
            gaps["speculation"] = "llama-server has no prompt-lookup speculation (llama_cpp.server has)"
        elif method == "draft_model" and not self.binary:
            gaps["speculation"] = "llama_cpp.server's draft models are prompt lookup only; use llama-server"
        elif method == "draft_model" and not self.draft_gguf:
            gaps["speculation"] = "a draft model needs a GGUF file (--draft-gguf)"
        if spec.get("adaptive"):
            gaps["speculation"] = "llama.cpp has no adaptive K"
        if levers.tensor_parallel_size != 1:
            gaps["tensor_parallel"] = "llama.cpp splits layers across devices, not tensors; none on CPU"
        if levers.data_parallel_size != 1:
            gaps["replicas"] = "llama-server is one process (--parallel adds slots, not replicas)"
        return gaps

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        return (self.server_command if self.binary else self.module_command)(
            self._model_file(model, levers) or model, levers, port
        )

    def server_command(self, gguf: str, levers: Levers, port: int) -> list[str]:
        cmd = [self.binary or "llama-server", "-m", gguf, "--port", str(port), "-c", str(self.n_ctx)]
        cmd += ["-np", str(levers.max_num_seqs), "--cont-batching"]
        if levers.kv_cache_dtype == "int8":
            cmd += ["-ctk", "q8_0", "-ctv", "q8_0"]
        spec = levers.speculative or {}
        if spec.get("method") == "draft_model":
            cmd += ["-md", self.draft_gguf or "", "--draft-max", str(spec.get("num_speculative_tokens", 4))]
        return cmd

    def module_command(self, gguf: str, levers: Levers, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port)]
        cmd += ["--n_ctx", str(self.n_ctx)]
        if levers.kv_cache_dtype == "int8":
            cmd += ["--type_k", str(GGML_TYPE_Q8_0), "--type_v", str(GGML_TYPE_Q8_0)]
        spec = levers.speculative or {}
        if spec.get("method") == "ngram":
            cmd += ["--draft_model", "prompt-lookup-decoding"]
            cmd += ["--draft_model_num_pred_tokens", str(spec.get("num_speculative_tokens", 4))]
        return cmd

    def extra_body(self, levers: Levers) -> dict | None:
        return None if levers.prefix_caching else {"cache_prompt": False}

    def capabilities(self) -> dict[str, str]:
        return {
            "precision": "a GGUF file per precision (--gguf NAME=FILE)",
            "kv_cache_dtype": "-ctk/-ctv q8_0 (int8 only)",
            "speculation": "draft model (llama-server -md), prompt lookup (llama_cpp.server); no EAGLE, no adaptive K",
            "prefix_caching": "per request: cache_prompt",
            "tensor_parallel": "not expressible (layer split only, GPU only)",
            "replicas": "not expressible (one server process; run several behind a balancer)",
            "batch_policy": "llama-server -np N",
        }
