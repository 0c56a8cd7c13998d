"""llama.cpp's server: a `llama-server` binary (on PATH, else the one built into the cache by
`python -m leverlab.bench.peer_llamacpp build`), else the `llama-cpp-python` package's server
(`python -m llama_cpp.server`).

llama.cpp reads GGUF files, so precision is a file, not a flag. The study makes them itself before the first
configuration (`prepare`): the checkpoint converted to GGUF bf16 by llama.cpp's own converter and each other
precision quantized from it by `llama-quantize` (leverlab/bench/peer_llamacpp.py, cached per checkpoint), the
draft model likewise; `--gguf PRECISION=FILE` overrides a file. Mapping:
  precision        the GGUF file: bfloat16 = BF16, int8 = Q8_0, int4 = Q4_0 (blocks of 32, one scale each)
  kv_cache_dtype   llama-server -ctk/-ctv q8_0; llama_cpp.server --type_k/--type_v 8 (GGML_TYPE_Q8_0)
  speculation      draft_model: llama-server -md DRAFT.gguf --spec-draft-n-max K; ngram: llama-server
                   --spec-type ngram-simple (lookup n-gram of prompt_lookup_min tokens, K drafted), or
                   llama_cpp.server's prompt-lookup-decoding; eagle: none; adaptive K: none
  prefix_caching   on by default in both (per request `cache_prompt`); off: the request sends cache_prompt=false
  tensor_parallel  none on CPU (multi-GPU splits layers, not tensors: --split-mode row is the nearest)
  batch_policy     llama-server -np N (parallel slots, continuous batching); llama_cpp.server: none
Threads: as many as LeverLab gives the same model (runner.engine_threads), so the engines compare on equal
cores. Slots: min(max_num_seqs, the plan's top concurrency), each with room for the longest request (-c is
the whole KV pool, split evenly between slots); more slots than clients would only reserve idle memory.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

from leverlab.study.engines.base import Engine, ServerHandle, StartFailed
from leverlab.study.plan import Levers

GGML_TYPE_Q8_0 = 8
# study precision -> peer_llamacpp's precision name (its GGUF_TYPES maps that to BF16 / Q8_0 / Q4_0)
PRECISIONS = {"bfloat16": "bf16", "int8": "int8", "int4": "int4"}
INSTALL_HINT = "python -m leverlab.bench.peer_llamacpp build"


def _cached_tool(name: str) -> str | None:
    """A llama.cpp tool from PATH, else from the cache build."""
    found = shutil.which(name)
    if found:
        return found
    from leverlab.bench import peer_llamacpp as peer

    p = peer.binaries(peer.default_dir()).get(name)
    return str(p) if p and p.exists() else None


class LlamaCppEngine(Engine):
    name = "llamacpp"
    fidelity_mode = "http"

    def __init__(
        self,
        gguf: dict[str, str] | None = None,
        draft_gguf: str | None = None,
        n_ctx: int = 4096,
        threads: int | None = None,
        **_,
    ):
        self.gguf = dict(gguf or {})
        self.draft_gguf = draft_gguf  # one file for every draft step; else converted per precision
        self.drafts: dict[tuple[str, str], str] = {}  # (draft folder, precision) -> GGUF, from prepare()
        self.models: dict[tuple[str, str], str] = {}  # (model lever folder, precision) -> GGUF, from prepare()
        self.errors: dict[str, str] = {}  # precision or draft -> why its file could not be made
        self.slot_ctx = n_ctx
        self.max_slots: int | None = None
        self.threads = threads
        self.binary = _cached_tool("llama-server")
        self.module = importlib.util.find_spec("llama_cpp") is not None and not self.binary

    @property
    def health_path(self) -> str:  # llama-server: 503 while loading, 200 once ready
        return "/health" if self.binary else "/v1/models"

    def installed(self) -> str | None:
        if self.binary or self.module:
            return None
        return f"not installed: no `llama-server` on PATH or in the cache (one step: `{INSTALL_HINT}`)"

    # ---- files ---------------------------------------------------------------------------------------------

    def prepare(self, model: str, plan, workload: Path, say=print) -> dict:
        """Every GGUF file the plan needs, converted and quantized by llama.cpp's own tools (cached), and the
        slot sizes from the workload. Returns what it made, for study.json."""
        import json

        from leverlab.study.runner import engine_threads

        buckets = json.loads(Path(workload).read_text())["buckets"].values()
        longest = max((b.get("input_tokens", 0) + b.get("output_len", 0) for b in buckets), default=1024)
        # Margin: a GGUF tokenizer may split a prompt into more tokens than the bucket's nominal length.
        self.slot_ctx = max(self.slot_ctx, int(longest * 1.25) + 64)
        self.max_slots = max(plan.concurrency or [1])
        if self.threads is None:
            self.threads = engine_threads(model, plan.steps[0].levers)
        if self.installed() or model.endswith(".gguf"):
            return {}
        want = {s.levers.precision_label() for s in plan.steps}
        todo = sorted(p for p in want if p in PRECISIONS and p not in self.gguf)
        drafts = {
            (s.levers.speculative["model"], s.levers.precision_label())
            for s in plan.steps
            if (s.levers.speculative or {}).get("method") == "draft_model"
            and s.levers.speculative.get("model")
            and s.levers.precision_label() in PRECISIONS
            and not self.draft_gguf
        }
        others = {
            (s.levers.model, s.levers.precision_label())
            for s in plan.steps
            if s.levers.model and s.levers.precision_label() in PRECISIONS
        }
        if not todo and not drafts and not others:
            return {}
        t0 = time.monotonic()
        made = {"gguf": {}, "draft_gguf": {}}
        for p, path in self._convert(model, todo, p_key=None).items():
            self.gguf[p] = path
            made["gguf"][p] = path
        for folder, prec in sorted(drafts):
            got = self._convert(folder, [prec], p_key=f"draft {folder}")
            if prec in got:
                self.drafts[(folder, prec)] = got[prec]
                made["draft_gguf"][f"{folder}@{prec}"] = got[prec]
        for folder, prec in sorted(others):
            got = self._convert(folder, [prec], p_key=f"model {folder}")
            if prec in got:
                self.models[(folder, prec)] = got[prec]
                made["gguf"][f"{folder}@{prec}"] = got[prec]
        made["setup_s"] = time.monotonic() - t0
        say(f"llama.cpp: GGUF files ready in {made['setup_s']:.0f} s")
        return made

    def _convert(self, folder: str, precisions: list[str], p_key: str | None) -> dict[str, str]:
        """{study precision: GGUF path}; a failure is kept in self.errors (its configurations then fail with
        the reason) rather than raised, so the precisions that did convert still run."""
        from leverlab.bench import peer_llamacpp as peer
        from leverlab.study.engines.base import resolve

        src = resolve(folder)
        quantize = _cached_tool("llama-quantize")
        key = lambda p: p_key or p  # noqa: E731
        if src is None or not src.is_dir():
            for p in precisions:
                self.errors[key(p)] = f"{folder} is not a model folder to convert"
            return {}
        if quantize is None:
            for p in precisions:
                self.errors[key(p)] = f"no llama-quantize on PATH or in the cache ({INSTALL_HINT})"
            return {}
        try:
            paths = peer.convert(
                src, peer.default_dir(), {"llama-quantize": Path(quantize)}, [PRECISIONS[p] for p in precisions], None
            )
        except (peer.PeerError, OSError) as e:
            for p in precisions:
                self.errors[key(p)] = f"GGUF conversion failed: {e}"
            return {}
        return {p: str(paths[PRECISIONS[p]]) for p in precisions}

    def _model_file(self, model: str, levers: Levers) -> str | None:
        if levers.model:
            return self.models.get((levers.model, levers.precision_label())) or (
                levers.model if levers.model.endswith(".gguf") else None
            )
        return self.gguf.get(levers.precision_label()) or (model if model.endswith(".gguf") else None)

    def _draft_file(self, levers: Levers) -> str | None:
        spec = levers.speculative or {}
        return self.draft_gguf or self.drafts.get((spec.get("model"), levers.precision_label()))

    # ---- levers ----------------------------------------------------------------------------------------------

    def unsupported(self, levers: Levers) -> dict[str, str]:
        gaps: dict[str, str] = {}
        if not levers.structured_jump_forward:
            gaps["structured"] = "llama.cpp's server has no jump-forward switch"
        prec = levers.precision_label()
        if levers.model and self._model_file("", levers) is None and f"model {levers.model}" not in self.errors:
            gaps["model"] = f"no GGUF file of {levers.model} at {prec}"
        elif not levers.model and self._model_file("", levers) is None and prec not in self.errors:
            gaps["precision"] = (
                f"no llama.cpp file type for {prec} (GGUF made for {', '.join(PRECISIONS)}; "
                f"or pass --gguf {prec}=FILE)"
                if prec not in PRECISIONS
                else f"no GGUF file for {prec} (pass --gguf {prec}=FILE)"
            )
        if levers.kv_cache_dtype not in ("auto", "int8"):
            gaps["kv_cache_dtype"] = (
                f"{levers.kv_cache_dtype} KV cache has no llama.cpp type (q8_0 is the int8 one)"
            )
        spec = levers.speculative or {}
        method = spec.get("method")
        if method in ("eagle", "eagle3"):
            gaps["speculation"] = (
                "no EAGLE here: llama-server's draft-eagle3 reads GGUF EAGLE-3 drafts, and nothing converts our "
                "head to one"
            )
        elif method == "draft_model" and not self.binary:
            gaps["speculation"] = "llama_cpp.server's draft models are prompt lookup only; use llama-server"
        elif method == "draft_model" and not self._draft_file(levers) and f"draft {spec.get('model')}" not in self.errors:
            gaps["speculation"] = "a draft model needs a GGUF file (--draft-gguf, or a draft folder to convert)"
        elif method not in (None, "ngram", "draft_model", "eagle", "eagle3"):
            gaps["speculation"] = f"no llama.cpp counterpart of speculative method {method!r}"
        if spec.get("adaptive"):
            gaps["speculation"] = "llama.cpp has no adaptive K"
        if levers.tensor_parallel_size != 1:
            gaps["tensor_parallel"] = "llama.cpp splits layers across devices, not tensors; none on CPU"
        if levers.data_parallel_size != 1:
            gaps["replicas"] = "llama-server is one process (--parallel adds slots, not replicas)"
        return gaps

    def start(self, model: str, levers: Levers, log_path: Path, timeout: float = 300.0) -> ServerHandle:
        """A file the study should have made and could not is a failure to look at, not a refusal."""
        spec = levers.speculative or {}
        keys = (
            f"model {levers.model}" if levers.model else levers.precision_label(),
            f"draft {spec.get('model')}" if spec.get("method") == "draft_model" else "",
        )
        for key in keys:
            if key in self.errors and not self.installed():
                raise StartFailed(self.errors[key], "failed")
        return super().start(model, levers, log_path, timeout)

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        return (self.server_command if self.binary else self.module_command)(
            self._model_file(model, levers) or model, levers, port
        )

    def slots(self, levers: Levers) -> int:
        return max(1, min(levers.max_num_seqs, self.max_slots or levers.max_num_seqs))

    def server_command(self, gguf: str, levers: Levers, port: int) -> list[str]:
        n = self.slots(levers)
        cmd = [self.binary or "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-c", str(n * self.slot_ctx), "-np", str(n), "--cont-batching", "--metrics"]
        if self.threads:
            cmd += ["-t", str(self.threads)]
        if levers.kv_cache_dtype == "int8":
            cmd += ["-ctk", "q8_0", "-ctv", "q8_0"]
        spec = levers.speculative or {}
        k = str(spec.get("num_speculative_tokens", 4))
        if spec.get("method") == "draft_model":
            cmd += ["-md", self._draft_file(levers) or "", "--spec-draft-n-max", k]
            if self.threads:
                cmd += ["-td", str(self.threads)]
        elif spec.get("method") == "ngram":
            lookup = str(spec.get("prompt_lookup_min", 2))
            cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", lookup]
            cmd += ["--spec-ngram-simple-size-m", k]
        return cmd

    def module_command(self, gguf: str, levers: Levers, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port)]
        cmd += ["--n_ctx", str(self.slot_ctx)]
        if self.threads:
            cmd += ["--n_threads", str(self.threads)]
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
            "precision": "GGUF files made by the study (BF16, Q8_0 = int8, Q4_0 = int4), or --gguf NAME=FILE",
            "kv_cache_dtype": "-ctk/-ctv q8_0 (int8 only)",
            "speculation": "draft model (-md), n-gram (--spec-type ngram-simple); no EAGLE, no adaptive K",
            "prefix_caching": "per request: cache_prompt",
            "tensor_parallel": "not expressible (layer split only, GPU only)",
            "replicas": "not expressible (one server process; run several behind a balancer)",
            "batch_policy": "llama-server -np N",
            "batching": "continuous in the server; static as a client-side workload (waves)",
            "model": "the model lever's folder, converted to GGUF like the study's model",
        }
