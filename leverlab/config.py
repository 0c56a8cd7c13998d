"""Engine configuration: plain dataclasses, checked once in __post_init__. CLI flags map onto these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from leverlab import env
from leverlab.hub import resolve_model
from leverlab.quant_config import check_kv_cache_dtype, check_lm_head_quantization, check_quantization
from leverlab.speculative_config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")


def default_model_path() -> Path:
    """The bundled default model, shipped in the repo (see models/README.md)."""
    return Path(__file__).resolve().parent.parent / "models" / "leverlab-code-15m"


@dataclass
class EngineConfig:
    model: str = ""  # a folder, or a Hugging Face Hub id (resolve_models turns it into the cached snapshot)
    revision: str | None = None  # the Hub id's branch, tag or commit (None: main)
    tokenizer: str | None = None  # a folder or Hub id; None: the model's own (a GGUF file's: from its metadata)
    tokenizer_revision: str | None = None
    model_id: str | None = None  # the Hub id `model` was resolved from (the default served name); set by resolve_models
    # vLLM's switch to run a repository's own model code. We never do: True is accepted for an architecture we
    # implement (our code runs) and refused, with that reason, for any other (models/config.py).
    trust_remote_code: bool = False
    dtype: str = "bfloat16"
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    max_model_len: int | None = None  # None: the model's context (max_position_embeddings, stretched by rope scaling)
    max_num_seqs: int = 64  # sequences in one step
    # Token budget per step (prefill chunks + decodes): vLLM's CPU server default. At 512, a 1,500-token prompt
    # took three chunks, and the later two (a cached prefix) missed the fresh-prefill attention path: its TTFT was
    # 3-9x vLLM's on the bundled model. A bigger chunk stalls running decodes longer, as it does in vLLM.
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256  # sequences: past max_num_seqs + this many running or waiting, EngineOverloaded
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit count wins over kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: a default sized for max_num_seqs full contexts, capped
    kv_cache_memory_fraction: float | None = None  # or this share of the memory free after loading weights
    enable_prefix_caching: bool = True  # automatic prefix caching (vLLM's default too)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    lm_head_quantization: str = "auto"  # the output head's precision (quant/registry.py: LM_HEAD_QUANTIZATION)
    speculative_config: dict | None = None
    # Structured output: tokens the grammar forces (the only one its mask allows) are appended without a decode
    # pass each and prefilled in the next pass (leverlab/structured/). Lossless: plain constrained decoding takes
    # a forced token without a draw too, so the output is token-identical either way.
    structured_outputs_jump_forward: bool = True
    tensor_parallel_size: int = 1  # > 1: one process per rank (leverlab/distributed, docs/tensor-parallel.md)
    # > 1: that many engine processes (replicas) behind the one endpoint (engine/replicas.py), each with
    # tensor_parallel_size ranks of its own
    data_parallel_size: int = 1
    # Tensor parallelism across hosts (distributed/rendezvous.py): one launch per host, ranks split evenly.
    # None / 1 / 0 here fall back to torch.distributed's environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK).
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    # "eager" (default): no compilation; decode steps take the fused C++ forward (models/fused.py) either way.
    # "compiled": Inductor compiles the module path too (long prefill chunks), at a start-up cost of 40 s to
    # minutes per model and precision (cached on disk): on the bundled model it measured no faster.
    execution_mode: str = field(default_factory=lambda: env.get("LEVERLAB_EXECUTION_MODE", "eager"))
    num_threads: int | None = None  # per rank; None: all cores (cores // tensor_parallel_size per rank)
    seed: int = 0

    def __post_init__(self) -> None:
        # vLLM's dtype names: "auto" (ours: bfloat16, the fast CPU path), "half", "float"
        self.dtype = {"auto": "bfloat16", "half": "float16", "float": "float32"}.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.execution_mode not in ("compiled", "eager"):
            raise ValueError(f"execution_mode must be 'compiled' or 'eager', got {self.execution_mode!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        # Whether the model's heads / vocabulary / MLP split over the ranks is checked when it loads
        # (distributed/parallel_state.py: check_model), with the numbers.
        if self.speculative_config:
            SpeculativeConfig.from_dict(self.speculative_config)  # refuses what is not built, clearly
        # Registry lookups (light: no kernels imported); unknown names are refused with the valid ones listed.
        self.quantization = check_quantization(self.quantization)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        self.lm_head_quantization = check_lm_head_quantization(self.lm_head_quantization)

    def resolve_models(self) -> EngineConfig:
        """Turn a Hub id in `model`, `tokenizer` or the speculative config's "model" into its local snapshot
        folder (hub.py: the cache, downloaded unless offline), in place; a path is kept. The engine and the
        server call this before anything reads the model, so every later part sees a folder. Idempotent."""
        if self.model and not Path(self.model).expanduser().exists():
            self.model_id = self.model
        self.model = resolve_model(self.model, self.revision)
        if self.tokenizer:
            self.tokenizer = resolve_model(self.tokenizer, self.tokenizer_revision, what="tokenizer")
        spec = self.speculative_config
        if spec and isinstance(spec.get("model"), str) and spec["model"]:
            self.speculative_config = {**spec, "model": resolve_model(spec["model"], spec.get("revision"),
                                                                      what="speculative model")}
        return self
