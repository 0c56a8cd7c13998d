"""Every LEVERLAB_* environment variable, the cache folder and the CPU's flags, in one place (no layer imports the engine for them).

| variable                      | effect                                                                  |
|-------------------------------|-------------------------------------------------------------------------|
| LEVERLAB_CACHE                | cache root: C++ kernels, Inductor's code, llama.cpp builds (~/.cache/leverlab) |
| LEVERLAB_EXECUTION_MODE       | default --execution-mode: eager (the default) or compiled               |
| LEVERLAB_COMPILE_MODE         | torch.compile mode of the compiled path (max-autotune-no-cudagraphs)    |
| LEVERLAB_WEIGHT_PREPACK=1     | let Inductor prepack weights with oneDNN (off: it defeats the FX cache) |
| LEVERLAB_NO_CPP_KERNELS=1     | never build or use our C++ kernels (the plain PyTorch paths)            |
| LEVERLAB_REQUIRE_CPP_KERNELS=1 | TESTS: the C++ kernels must build, or the test session stops (.ci/run sets it) |
| LEVERLAB_NO_SKINNY_LINEAR=1   | aten's linear instead of our streaming bf16 kernel (A/B runs)            |
| LEVERLAB_STREAM_PREFETCH      | every kernel family's weight prefetch, off / nta / t0 / l2, instead of measuring each at load (layers/prefetch_tune.py); LEVERLAB_NO_STREAM_PREFETCH=1: off |
| LEVERLAB_NO_HUGE_PAGES=1     | leave a CPU model's weights in 4 KB pages (kernels/huge_pages.py; A/B runs) |
| LEVERLAB_NO_AMX=1            | no AMX kernels of ours: batched int8 rows on fbgemm's GEMM (quant/int8_gemm.py), bf16 decode rows on the streaming kernel (layers/bf16_linear.py); A/B runs |
| LEVERLAB_NO_BF16_TILES=1    | keep bf16 layers in place instead of in AMX tile order (models/loader.py `tile_bf16_layers`); A/B runs |
| LEVERLAB_NO_GROUPED_GEMM=1    | an int8 prefill's gate_up through the plain AMX GEMM, then SiLU in a pass of its own, instead of SiLU on the GEMM's outputs in L1 (A/B runs) |
| LEVERLAB_NO_FUSED_DECODE=1    | decode steps through the modules instead of the fused C++ forward       |
| LEVERLAB_NO_FUSED_MOE=1       | an MoE layer's hit experts one module call each instead of one C++ op (A/B runs) |
| LEVERLAB_TP_STEP_TIMEOUT_S    | seconds before a hung tensor-parallel rank fails the step (30)          |
| LEVERLAB_API_KEY              | the server's API key when --api-key is not given                        |
| LEVERLAB_TEST_FAIL_AT_STEP    | TESTS ONLY: the server's engine loop raises at that step (failure path) |
| WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE | torchrun's: hosts, this host, the rendezvous, at TP > 1 when the flags are unset (distributed/rendezvous.py) |
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from leverlab.models.config import ModelConfig


def get(name: str, default: str) -> str:
    return os.environ.get(name, default)


def flag(name: str) -> bool:
    """A switch that is on when set to 1."""
    return os.environ.get(name) == "1"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo ("avx512_vnni", "amx_tile", ...); empty off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), ":")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def cache_dir() -> Path:
    """The cache root; each user of it takes a subfolder."""
    return Path(os.environ.get("LEVERLAB_CACHE", Path.home() / ".cache" / "leverlab"))


def test_fail_at_step() -> int | None:
    """TESTS ONLY (tests/server/test_hardening.py): make AsyncLLM's loop raise at this engine step, so the
    failure path (error events, exit non-zero) can be shown on a real server. Unset in any real use."""
    v = os.environ.get("LEVERLAB_TEST_FAIL_AT_STEP")
    return int(v) if v else None


def pick_device(name: str) -> torch.device:
    """--device: "auto" picks cuda when present, else cpu."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_threads(cfg: ModelConfig, dtype: str) -> int:
    """All cores, except for small models: their matmuls are too short to repay a fork/join per op, and
    on a shared machine every op of a multi-threaded step waits for the slowest (possibly descheduled)
    thread: measured here, a 15M model decoded at 63 tok/s on one thread and 1.6 tok/s on two while
    another process kept a core busy."""
    import torch

    weight_bytes = cfg.weight_bytes(2 if dtype in ("bfloat16", "float16") else 4)
    return 1 if weight_bytes < 256 * 2**20 else max(1, torch.get_num_threads())
