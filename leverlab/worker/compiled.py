"""The fast path: the model's forward compiled by Inductor, with the compiled code cached on disk.

Why this shape: decode on a CPU is bound by how fast the weights stream through the matmuls. Inductor with
frozen weights (constants it can prepack) and max-autotune picks its own GEMM templates and fuses the
norms, rotary and activations around them; the paged-attention custom op stays an opaque eager call, so
one graph serves every batch layout. The token count is a dynamic dimension: one compilation covers
prefill chunks and decode batches of any size.
"""

from __future__ import annotations

import logging
import os

import torch

from leverlab import env
from leverlab.config import EngineConfig
from leverlab.env import cache_dir

log = logging.getLogger("leverlab")


def compile_forward(model: torch.nn.Module, config: EngineConfig):
    """model.forward compiled; the first call per graph shape compiles (or loads from the disk cache)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    import torch._inductor.config as inductor_config

    from leverlab.layers import bf16_linear

    torch.compiler.assume_constant_result(bf16_linear.available)  # marks the function itself (layers/bf16_linear.py)

    # Set globally: passing {"freezing": True} through torch.compile's options is silently ignored.
    inductor_config.freezing = True
    inductor_config.fx_graph_cache = True
    if model.lm_head.weight.device.type == "cpu":
        # oneDNN-prepacked weights are unpicklable, which bypasses the FX graph cache (every start would
        # recompile: 88 s against 38 s warm for the 0.6B shape), and measured no faster here (148 vs 145 ms
        # per 16-sequence step). LEVERLAB_WEIGHT_PREPACK=1 turns them back on.
        inductor_config.cpp.weight_prepack = env.flag("LEVERLAB_WEIGHT_PREPACK")
    return torch.compile(model.forward, dynamic=True, fullgraph=False,
                         mode=env.get("LEVERLAB_COMPILE_MODE", "max-autotune-no-cudagraphs"))
