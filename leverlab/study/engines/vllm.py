"""vLLM (`vllm serve`), on GPU machines: the reference study's engine, with the same flag names as ours.

Flags checked against vLLM's own sources (vllm/config/speculative.py and cache.py of vLLM main, snapshot read
2026-11-30; `--speculative-config` as JSON is the form since v0.8): `--speculative-config` JSON keys method (ngram, draft_model, eagle, eagle3, ...),
model, num_speculative_tokens, prompt_lookup_min/max (required for ngram: filled with our defaults 2/4 when a
plan leaves them out), draft_tensor_parallel_size; keys of ours that vLLM does not know (adaptive, and
disable_by_batch_size, which vLLM dropped for num_speculative_tokens_per_batch_size) are never passed.
`--quantization fp8`, `--kv-cache-dtype fp8`, `--enable-prefix-caching` / `--no-enable-prefix-caching`,
`--tensor-parallel-size`, `--data-parallel-size` (the replicas lever, when a plan has it), `--max-num-seqs`.

Speculation: an EAGLE head in our own format is handed over as its `speculators` export (method "eagle3",
spec/eagle3_format.py); a published speculators head passes as it is.

Precision: vLLM quantizes to fp8 on the fly (`--quantization fp8`); int8 is mapped to fp8 (the reference
study's 8-bit step) and said so; int4 needs a pre-quantized AWQ/GPTQ checkpoint (--vllm-checkpoint int4=DIR),
as the reference used Qwen/Qwen3-8B-AWQ.
"""

from __future__ import annotations

import json
import shutil

from leverlab.study.engines.base import Engine, served_model
from leverlab.study.plan import Levers

ON_THE_FLY = {"int8": "fp8", "fp8": "fp8"}
# The keys of --speculative-config this adapter passes (vLLM's SpeculativeConfig names them the same).
VLLM_SPEC_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
)


def _eagle_problem(head: str) -> str | None:
    """Why vLLM could not run this EAGLE head (None: it can, or the folder is not here to judge)."""
    from leverlab.errors import UnsupportedLever
    from leverlab.spec.eagle3_format import detect_format, vllm_problems
    from leverlab.spec.eagle_head import EagleConfig
    from leverlab.study.engines.leverlab import resolve

    path = resolve(head)
    if path is None:
        return None
    try:
        if detect_format(path) != "leverlab":
            return None
        cfg = EagleConfig.from_folder(path)
    except UnsupportedLever as e:
        return str(e)
    problems = vllm_problems(cfg, cfg.target_num_layers)
    return "EAGLE head for vLLM: " + "; ".join(problems) if problems else None


class VLLMEngine(Engine):
    name = "vllm"
    health_path = "/health"
    fidelity_mode = "http"

    def __init__(self, checkpoints: dict[str, str] | None = None, **_):
        self.checkpoints = dict(checkpoints or {})
        self.binary = shutil.which("vllm")

    def installed(self) -> str | None:
        if not self.binary:
            return "not installed: no `vllm` on PATH (vLLM needs a GPU machine)"
        try:
            import torch

            if not torch.cuda.is_available():
                return "no GPU on this machine: vLLM serves on GPUs"
        except ImportError:
            pass
        return None

    def unsupported(self, levers: Levers) -> dict[str, str]:
        gaps: dict[str, str] = {}
        q = levers.quantization
        if q and q not in ON_THE_FLY and q not in self.checkpoints:
            gaps["precision"] = f"{q} needs a pre-quantized checkpoint (--vllm-checkpoint {q}=DIR)"
        spec = levers.speculative or {}
        if spec.get("adaptive"):
            gaps["speculation"] = "vLLM has no adaptive K (its nearest: num_speculative_tokens_per_batch_size)"
        elif spec.get("disable_by_batch_size") is not None:
            gaps["speculation"] = "vLLM dropped disable_by_batch_size (num_speculative_tokens_per_batch_size)"
        elif spec.get("method") in ("eagle", "eagle3") and spec.get("model"):
            why = _eagle_problem(spec["model"])
            if why:
                gaps["speculation"] = why
        return gaps

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        q = levers.quantization
        model = served_model(model, levers)
        model = self.checkpoints.get(q, model) if q and not levers.model else model
        cmd = [self.binary or "vllm", "serve", model, "--port", str(port), "--dtype", levers.dtype]
        if q in ON_THE_FLY and q not in self.checkpoints:
            cmd += ["--quantization", ON_THE_FLY[q]]
        if levers.kv_cache_dtype != "auto":
            cmd += [
                "--kv-cache-dtype",
                "fp8" if levers.kv_cache_dtype in ("int8", "fp8") else levers.kv_cache_dtype,
            ]
        if levers.speculative:
            cmd += ["--speculative-config", json.dumps(self._spec(levers.speculative, model), sort_keys=True)]
        cmd += ["--enable-prefix-caching" if levers.prefix_caching else "--no-enable-prefix-caching"]
        cmd += ["--tensor-parallel-size", str(levers.tensor_parallel_size)]
        if levers.data_parallel_size != 1:
            cmd += ["--data-parallel-size", str(levers.data_parallel_size)]
        cmd += ["--max-num-seqs", str(levers.max_num_seqs)]
        return cmd

    @staticmethod
    def _spec(spec: dict, model: str) -> dict:
        """vLLM's keys only; ngram with its lookup window spelled out; our EAGLE head folders become their
        speculators export, which vLLM loads as method eagle3."""
        from leverlab.spec.config import SpeculativeConfig

        spec = {k: v for k, v in spec.items() if k in VLLM_SPEC_KEYS}
        if spec.get("method") == "ngram":
            spec.setdefault("prompt_lookup_min", SpeculativeConfig.prompt_lookup_min)
            spec.setdefault("prompt_lookup_max", SpeculativeConfig.prompt_lookup_max)
        if spec.get("method") in ("eagle", "eagle3") and spec.get("model"):
            from leverlab.spec.eagle3_format import speculators_export_of
            from leverlab.study.engines.leverlab import resolve

            head, target = resolve(spec["model"]), resolve(model)
            if head is not None and target is not None:
                spec.update(method="eagle3", model=str(speculators_export_of(head, target)))
        return spec

    def capabilities(self) -> dict[str, str]:
        return {
            "precision": "--quantization fp8 on the fly (int8 -> fp8); int4 from an AWQ/GPTQ checkpoint",
            "kv_cache_dtype": "--kv-cache-dtype fp8 (int8 -> fp8)",
            "speculation": "--speculative-config ngram | draft_model | eagle3 (our heads as speculators); no adaptive K",
            "prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
            "tensor_parallel": "--tensor-parallel-size",
            "replicas": "--data-parallel-size",
            "batch_policy": "--max-num-seqs",
            "batching": "continuous in the engine; static as a client-side workload (waves)",
            "model": "the model served (right-sizing)",
        }
