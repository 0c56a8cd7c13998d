"""Our own CPU kernels (csrc/), compiled on first use with the machine's C++ compiler and cached.

If compilation fails (no compiler, odd platform) callers fall back to the plain-PyTorch path and the
reason is logged once. LEVERLAB_NO_CPP_KERNELS=1 forces the fallback.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path

from leverlab import env

log = logging.getLogger("leverlab")
SRC = Path(__file__).parent / "csrc"


@cache
def kernels():
    """The compiled module, or None when it cannot be built here."""
    if env.flag("LEVERLAB_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        build = env.cache_dir() / "cpp_kernels"
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > 600:
            # A build killed midway leaves its lock behind, and every later load would wait on it forever.
            log.warning("removing a stale build lock %s", lock)
            lock.unlink(missing_ok=True)
        sources = [str(SRC / name) for name in ("bindings.cpp", "paged_decode.cpp", "skinny_linear.cpp", "quant_linear.cpp",
                                                   "fused_decoder.cpp")]
        module = load(name="leverlab_cpu_kernels", sources=sources, build_directory=str(build),
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                      verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the PyTorch path
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
    if module.has_skinny_linear():  # loading registered the op leverlab_cpu::linear_bf16 (skinny_linear.cpp)
        import torch

        torch.library.register_fake("leverlab_cpu::linear_bf16")(_linear_shape)
    return module


def _linear_shape(x, weight, bias):  # what a compiled graph needs to know of leverlab_cpu::linear_bf16
    return x.new_empty(*x.shape[:-1], weight.shape[0])
