"""Our own CPU kernels (csrc/): built once per content into the cache, and loaded from there by every checkout.

The build folder is keyed by what the binary depends on and nothing else: every source and header, torch's version,
Python's extension ABI, the flags, and this CPU's features (which -march=native compiles for). The sources are
copied into the folder and compiled from those copies, so the ninja file names the same paths whichever checkout
built it; once the library is there it is imported directly, without asking ninja. Two checkouts of the same
commit (a user's clone beside CI's, a working tree beside a fresh clone) therefore share one build instead of
rebuilding each time they alternate (that took 2-5 minutes each, 15 under load).

`scripts/venv.sh` builds them at setup (`build()`, which raises on failure), so the first model load does not pay
the compile. At run time, `kernels()` returns None where they cannot be built (no compiler, odd platform), and
callers fall back to the plain-PyTorch path with the reason logged once. LEVERLAB_NO_CPP_KERNELS=1 forces the
fallback; whether the kernels prefetch their weights is measured per model at load (layers/prefetch_tune.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import shutil
import sys
import sysconfig
import threading
import time
from functools import cache
from pathlib import Path

from leverlab import env

log = logging.getLogger("leverlab")
SRC = Path(__file__).parent / "csrc"
NAME = "leverlab_cpu_kernels"
# Every .cpp in csrc/ is one translation unit of the module: a new kernel file is built by being there, not by
# also being named in a list here.
SOURCES = tuple(sorted(f.name for f in SRC.glob("*.cpp")))
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
DONE = "leverlab.built"  # written after a build succeeded: the folder's library is complete


def _source_files() -> list[Path]:
    return sorted(f for f in SRC.iterdir() if f.suffix in (".cpp", ".h"))


def build_key() -> str:
    """The build folder's name: a hash of the sources' content, torch's version, Python's extension ABI, the
    flags and this CPU's features. No path enters it: the folder serves every checkout of the same sources."""
    import torch

    h = hashlib.sha256()
    for f in _source_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(f"{torch.__version__} {sysconfig.get_config_var('EXT_SUFFIX')} {' '.join(CFLAGS)} "
             f"{' '.join(LDFLAGS)} {' '.join(sorted(env.cpu_flags()))}".encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    return env.cache_dir() / "cpp_kernels" / build_key()


def _import(library: Path):
    """Import the built extension module from its file (what torch's load() does once ninja is done)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


def _compile(build: Path):
    """Copy the sources into build/src and compile them there. Call with build's flock held."""
    from torch.utils.cpp_extension import load

    src = build / "src"
    src.mkdir(exist_ok=True)
    for f in _source_files():  # the copies, not the checkout's files: the ninja file names only paths under build
        if not (src / f.name).exists() or (src / f.name).read_bytes() != f.read_bytes():
            shutil.copyfile(f, src / f.name)
    # torch's own build lock is a plain file: a build killed midway (Ctrl-C during setup) leaves it behind and
    # every later build waits on it forever, silently. Our flock dies with its holder, so whoever holds it knows
    # that any torch lock still present is stale.
    (build / "lock").unlink(missing_ok=True)
    t0 = time.monotonic()
    # A cached build loads in well under a second; only a compile takes longer, so say so then.
    notice = threading.Timer(5.0, log.info, ("compiling the CPU kernels (first start, or the sources changed): "
                                             "1-3 minutes, cached in %s", build))
    notice.daemon = True
    notice.start()
    try:
        module = load(name=NAME, sources=[str(src / name) for name in SOURCES], build_directory=str(build),
                      extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)
    finally:
        notice.cancel()
    (build / DONE).write_text(f"{time.monotonic() - t0:.1f} s\n")
    if time.monotonic() - t0 > 5.0:
        log.info("CPU kernels built in %.0f s", time.monotonic() - t0)
    sys.modules[NAME] = module
    return module


def _load(build: Path):
    """The compiled module: imported from `build` when this content was built there before, else built now.
    Raises whatever the build raised."""
    library = build / f"{NAME}.so"  # the name torch's load() gives it
    if (build / DONE).exists() and library.exists():
        return _import(library)
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "leverlab.flock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish building the CPU kernels in %s", build)
            fcntl.flock(held, fcntl.LOCK_EX)
        if (build / DONE).exists() and library.exists():  # built while we waited
            return _import(library)
        return _compile(build)


def _configure(module):
    if env.flag("LEVERLAB_NO_AMX"):  # bf16 decode rows on the streaming kernel (the int8 GEMM: quant/int8_gemm.py)
        module.set_amx_bf16(False)
    if module.has_skinny_linear():  # loading registered the op leverlab_cpu::linear_bf16 (skinny_linear.cpp)
        import torch

        torch.library.register_fake("leverlab_cpu::linear_bf16")(_linear_shape)
        torch.library.register_fake("leverlab_cpu::linear_bf16_tiles")(_tiles_shape)
    return module


def build() -> Path:
    """Build the kernels for this machine now (setup: scripts/venv.sh) and return the folder; raises if the
    build fails, with the compiler's error, instead of leaving the engine on its slow paths."""
    build = build_dir()
    _load(build)
    return build


@cache
def kernels():
    """The compiled module, or None when it cannot be built here."""
    if env.flag("LEVERLAB_NO_CPP_KERNELS"):
        return None
    try:
        module = _load(build_dir())
    except Exception as e:  # noqa: BLE001 - any build failure means: use the PyTorch path
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
    return _configure(module)


def _linear_shape(x, weight, bias):  # what a compiled graph needs to know of leverlab_cpu::linear_bf16
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _tiles_shape(x, tiles, n, bias):  # the same for leverlab_cpu::linear_bf16_tiles (amx_bf16_tiles.cpp)
    return x.new_empty(*x.shape[:-1], n)


if __name__ == "__main__":  # python -m leverlab.kernels.cpu_kernels: build now (scripts/venv.sh runs it)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"CPU kernels ready in {build()}")
