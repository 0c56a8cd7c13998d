"""LeverLab's own server: `leverlab serve` with vLLM-named lever flags.

Levers the engine has not built are refused by the server itself at start-up (exit 2 and a message): the
adapter passes every lever through and lets the engine say no, so the report quotes the engine's reason.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from leverlab.study.engines.base import Engine, resolve, served_model
from leverlab.study.plan import Levers


class LeverLabEngine(Engine):
    name = "leverlab"
    fidelity_mode = "http"  # from the configuration's own server: no model load per configuration
    inprocess_exactness = True  # speculative steps: a float32 spec-on/spec-off pair through the Python API

    def __init__(self, execution_mode: str = "eager", max_num_batched_tokens: int | None = None,
                 checkpoints: dict[str, str] | None = None, **_):
        self.execution_mode = execution_mode
        self.max_num_batched_tokens = max_num_batched_tokens
        # precision -> a pre-quantized folder (--checkpoint P=DIR: a published compressed-tensors / AWQ / GPTQ
        # release), served instead of quantizing the model at load; the same folder vLLM is given
        self.checkpoints = dict(checkpoints or {})

    def weights(self, model: str, levers: Levers) -> str:
        prec = levers.precision_label()
        if prec in self.checkpoints and not levers.model:
            return str(resolve(self.checkpoints[prec]) or self.checkpoints[prec])
        return served_model(model, levers)

    def prepare(self, model: str, plan, workload: Path, say=print) -> dict:
        """The C++ kernels built here, once, before any server starts: a first build takes 1-3 minutes (more on
        a loaded machine) and would otherwise fall inside the first server's health timeout, and a server killed
        mid-build makes the next one start over."""
        import time

        from leverlab.kernels.cpu_kernels import kernels

        t0 = time.monotonic()
        say("LeverLab: loading the CPU kernels (built on first use: 1-3 minutes, once)")
        ok = kernels() is not None
        return {"cpu_kernels": ok, "setup_s": time.monotonic() - t0}

    def precheck(self, model: str, levers: Levers) -> str | None:
        """EngineConfig's own validation (what `leverlab serve` checks first): refusals without a server start."""
        from leverlab.config import EngineConfig
        from leverlab.errors import UnsupportedLever

        if levers.model and resolve(levers.model) is None:
            return f"model: the folder {levers.model} does not exist"
        if levers.batching not in ("continuous", "static"):
            return f"batching: {levers.batching!r} is not continuous or static"
        model = self.weights(model, levers)
        spec = self._spec(levers)
        try:
            EngineConfig(
                model=model,
                dtype=levers.dtype,
                quantization=levers.quantization,
                kv_cache_dtype=levers.kv_cache_dtype,
                speculative_config=spec,
                tensor_parallel_size=levers.tensor_parallel_size,
                data_parallel_size=levers.data_parallel_size,
                enable_prefix_caching=levers.prefix_caching,
                max_num_seqs=levers.max_num_seqs,
                execution_mode=self.execution_mode,
            )
        except UnsupportedLever as e:
            return str(e)
        except (ValueError, TypeError) as e:
            return f"invalid setting: {e}"
        # After the engine's own checks, so a method that is not built says so rather than "no folder".
        draft = (levers.speculative or {}).get("model")
        if draft and resolve(draft) is None:
            return f"speculation: the draft/head model folder {draft} does not exist (yet)"
        return None

    @staticmethod
    def _spec(levers: Levers) -> dict | None:
        if not levers.speculative:
            return None
        spec = dict(levers.speculative)
        if spec.get("model"):
            spec["model"] = str(resolve(spec["model"]) or spec["model"])
        return spec

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "leverlab.cli", "serve", self.weights(model, levers), "--port", str(port)]
        cmd += ["--dtype", levers.dtype, "--execution-mode", self.execution_mode]
        if levers.quantization:
            cmd += ["--quantization", levers.quantization]
        cmd += ["--kv-cache-dtype", levers.kv_cache_dtype]
        if levers.speculative:
            cmd += ["--speculative-config", json.dumps(self._spec(levers), sort_keys=True)]
        cmd += ["--enable-prefix-caching" if levers.prefix_caching else "--no-enable-prefix-caching"]
        cmd += ["--tensor-parallel-size", str(levers.tensor_parallel_size)]
        if levers.data_parallel_size != 1:
            cmd += ["--data-parallel-size", str(levers.data_parallel_size)]
        cmd += ["--max-num-seqs", str(levers.max_num_seqs)]
        if not levers.structured_jump_forward:
            cmd += ["--no-structured-outputs-jump-forward"]
        if self.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return cmd

    def env(self, levers: Levers | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def capabilities(self) -> dict[str, str]:
        return {
            "precision": "--dtype, --quantization int8|int4|fp8|awq|gptq; --checkpoint P=DIR serves a pre-quantized "
            "folder (compressed-tensors, AWQ, GPTQ) for precision P",
            "kv_cache_dtype": "--kv-cache-dtype int8|fp8",
            "speculation": "--speculative-config (the engine refuses methods not built yet)",
            "prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
            "tensor_parallel": "--tensor-parallel-size (one process per rank, cores // size threads each)",
            "replicas": "--data-parallel-size (one engine process per replica, prefix-affinity routing)",
            "batch_policy": "--max-num-seqs",
            "batching": "continuous in the engine; static as a client-side workload (waves), on any engine",
            "model": "the model folder served (right-sizing)",
            "structured": "--structured-outputs-jump-forward / --no-structured-outputs-jump-forward",
        }
