"""Our own CPU kernels (csrc/), compiled on first use with the machine's C++ compiler and cached.

If compilation fails (no compiler, odd platform) callers fall back to the plain-PyTorch path and the
reason is logged once. LEVERLAB_NO_CPP_KERNELS=1 forces the fallback; whether the kernels prefetch their weights is
measured per model at load (layers/prefetch_tune.py).
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from functools import cache
from pathlib import Path

from leverlab import env

log = logging.getLogger("leverlab")
SRC = Path(__file__).parent / "csrc"


CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def build_key() -> str:
    """The build folder's name: a hash of what the binary depends on (every source and header, torch's version,
    the flags, this CPU's features, which -march=native compiles for) and of the checkout's own source folder.
    One folder per key, not one for all: torch writes the absolute source paths into its ninja file, and ninja
    rebuilds when they change, so two checkouts sharing a folder (a user's clone beside CI's, a working tree beside
    a fresh clone) rebuilt everything each time they alternated (2-5 minutes each; 15 under load)."""
    import hashlib

    import torch

    h = hashlib.sha256(str(SRC.resolve()).encode())
    for f in sorted(SRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(f"{torch.__version__} {' '.join(CFLAGS)} {' '.join(sorted(env.cpu_flags()))}".encode())
    return h.hexdigest()[:16]


@cache
def kernels():
    """The compiled module, or None when it cannot be built here."""
    if env.flag("LEVERLAB_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        sources = [str(SRC / name) for name in ("bindings.cpp", "paged_decode.cpp", "skinny_linear.cpp",
                                                   "quant_linear.cpp", "fused_decoder.cpp", "amx_int8.cpp",
                                                   "amx_bf16.cpp")]
        build = env.cache_dir() / "cpp_kernels" / build_key()
        build.mkdir(parents=True, exist_ok=True)
        # torch's own build lock is a plain file: a build killed midway (Ctrl-C during the first start) leaves
        # it behind and every later start waits on it forever, silently. An flock dies with its holder, so
        # whoever holds ours knows that any torch lock still present is stale.
        with open(build / "leverlab.flock", "w") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process to finish building the CPU kernels in %s", build)
                fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            t0 = time.monotonic()
            # A cached build loads in well under a second; only a compile takes longer, so say so then.
            notice = threading.Timer(5.0, log.info, ("compiling the CPU kernels (first start, or the sources "
                                                     "changed): 1-3 minutes, cached in %s", build))
            notice.daemon = True
            notice.start()
            try:
                module = load(name="leverlab_cpu_kernels", sources=sources, build_directory=str(build),
                              extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                              verbose=False)
            finally:
                notice.cancel()
            if time.monotonic() - t0 > 5.0:
                log.info("CPU kernels built in %.0f s", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the PyTorch path
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
    if env.flag("LEVERLAB_NO_AMX"):  # bf16 decode rows on the streaming kernel (the int8 GEMM: quant/int8_gemm.py)
        module.set_amx_bf16(False)
    if module.has_skinny_linear():  # loading registered the op leverlab_cpu::linear_bf16 (skinny_linear.cpp)
        import torch

        torch.library.register_fake("leverlab_cpu::linear_bf16")(_linear_shape)
    return module


def _linear_shape(x, weight, bias):  # what a compiled graph needs to know of leverlab_cpu::linear_bf16
    return x.new_empty(*x.shape[:-1], weight.shape[0])
