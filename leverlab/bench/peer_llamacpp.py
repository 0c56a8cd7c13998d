"""llama.cpp as a peer for scripts/bench_peer.py: built once from the source vendored in llama-cpp-python's
sdist, and our checkpoints converted to GGUF with its own converter, both cached.

Why from the sdist: PyPI is the only registry reachable here, and llama-cpp-python pins one llama.cpp
commit, so a version number names exactly the code measured. Why the converter from the same source: a GGUF
written by another gguf-py version may carry keys this llama.cpp reads differently.

    python -m leverlab.bench.peer_llamacpp build     (the study's llama.cpp install step, once: 6-25 min on 2 cores)
    python -m leverlab.bench.peer_llamacpp convert --src VENDOR_DIR --pre NAME MODEL OUT.gguf   (the wrapper)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from leverlab import env

VERSION = "0.3.36"  # llama-cpp-python, which pins the llama.cpp commit built here
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
# our precision name -> llama.cpp file type of the same role
GGUF_TYPES = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}


class PeerError(RuntimeError):
    """A step of building or converting failed; the message says which and how to fix it."""


def default_dir() -> Path:
    return env.cache_dir() / "llamacpp" / VERSION  # the project's cache root ($LEVERLAB_CACHE)


def _run(cmd: list, log: Path, cwd: Path | None = None, env: dict | None = None) -> None:
    """Run cmd with its output in `log`; on failure raise with the log's tail, the part that says why."""
    print(f"  $ {' '.join(map(str, cmd))}", flush=True)
    with open(log, "ab") as f:
        rc = subprocess.call([str(c) for c in cmd], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise PeerError(f"{Path(str(cmd[0])).name} failed (exit {rc}); last lines of {log}:\n{tail(log)}")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def source_dir(root: Path) -> Path:
    """vendor/llama.cpp of the unpacked sdist, downloaded and unpacked on first use."""
    src = root / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    dl = root / "download"
    dl.mkdir(exist_ok=True)
    sdists = list(dl.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not sdists:
        print(f"llama.cpp: downloading the llama-cpp-python {VERSION} sdist (about 75 MB) into {dl}", flush=True)
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={VERSION}", "-d", dl], root / "download.log")
        sdists = list(dl.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
        if not sdists:
            raise PeerError(f"pip download left no llama_cpp_python-{VERSION}.tar.gz in {dl}")
    print(f"llama.cpp: unpacking {sdists[0].name}", flush=True)
    with tarfile.open(sdists[0]) as tf:
        tf.extractall(root / "src", filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise PeerError(f"the sdist has no vendor/llama.cpp at {src}")
    return src


def _cmake() -> str:
    """cmake from PATH or the venv; a clear message when there is none (no network install behind our back)."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if not found:
        raise PeerError("cmake not found. `pip install cmake` into this virtualenv ships a binary "
                        f"({sys.executable} -m pip install cmake), or install it with the system's packages.")
    for cc in ("c++", "g++", "clang++"):
        if shutil.which(cc):
            return found
    raise PeerError("no C++ compiler (c++, g++ or clang++) on PATH: install one (e.g. apt-get install g++)")


def binaries(root: Path) -> dict[str, Path]:
    return {t: root / "build" / "bin" / t for t in TARGETS}


def build_flags(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """Extra compiler flags for this CPU's build, on top of GGML_NATIVE's -march=native.

    Where the CPU has AMX, -march=native compiles ggml's AMX matmul (ggml-cpu/amx), which in the llama.cpp that
    llama-cpp-python 0.3.36 pins dies on its first tile instruction (SIGILL in ggml_backend_amx_mul_mat, seen
    on a 2-vCPU Xeon with AMX for every Q8_0 and Q4_0 run, BF16 unaffected): the tile configuration is built on
    the stack, where the compiler may drop its stores (llama.cpp pull request #26954). A user would build it
    without that path, so the peer does too; explicit -mno- flags win over -march=native in any order.
    """
    flags = env.cpu_flags() if flags is None else flags
    return ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"] if "amx_tile" in flags else []


def ensure_built(root: Path, jobs: int | None = None) -> dict[str, Path]:
    """The four binaries, built on first use (about 6 minutes on 2 cores) and reused after; rebuilt when this
    CPU's build flags differ from those the cached build had (a cache folder moved to another machine)."""
    bins = binaries(root)
    extra = build_flags()
    stamp = root / "build" / "leverlab-build-flags.json"
    try:
        built_with = json.loads(stamp.read_text())
    except (OSError, ValueError):
        built_with = [] if stamp.parent.exists() else None  # builds from before the stamp had no extra flags
    if all(p.exists() for p in bins.values()) and built_with == extra:
        print(f"llama.cpp {VERSION}: using the build in {root / 'build'}", flush=True)
        return bins
    cmake = _cmake()
    src = source_dir(root)
    build, log = root / "build", root / "build.log"
    jobs = jobs or os.cpu_count() or 1
    print(f"llama.cpp {VERSION}: building {', '.join(TARGETS)} in {build} with {jobs} jobs "
          f"(log {log}); this takes minutes, once", flush=True)
    t0 = time.perf_counter()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    # GGML_NATIVE: -march=native, the SIMD this CPU has (what a user building llama.cpp here gets).
    # Static libraries: the binaries do not depend on where the build folder sits.
    # No OpenSSL, no prebuilt web UI (it is fetched from the network; loopback needs none), no tests/examples.
    # LLAMA_CURL is gone in this version (deprecated to a warning; downloads use cpp-httplib), so not passed.
    if extra:
        print(f"llama.cpp {VERSION}: this CPU has AMX; building without ggml's AMX matmul ({' '.join(extra)}), "
              "which crashes in this version", flush=True)
    cflags = " ".join(extra)  # always passed: a cached CMakeCache must not keep an earlier build's flags
    _run([cmake, "-S", src, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          f"-DCMAKE_C_FLAGS={cflags}", f"-DCMAKE_CXX_FLAGS={cflags}",
          "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"], log)
    _run([cmake, "--build", build, "--config", "Release", "-j", str(jobs), "--target", *TARGETS], log)
    missing = [t for t, p in bins.items() if not p.exists()]
    if missing:
        raise PeerError(f"the build finished without {missing} in {build / 'bin'}; see {log}")
    stamp.write_text(json.dumps(extra))
    print(f"llama.cpp {VERSION}: built in {time.perf_counter() - t0:.0f} s", flush=True)
    return bins


def model_key(model: Path) -> str:
    """Identity of a checkpoint for the GGUF cache: its config, tokenizer and weights' names, sizes, mtimes."""
    h = hashlib.sha256()
    for p in sorted(model.iterdir()):
        if p.suffix in (".safetensors", ".json"):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return f"{model.name}-{h.hexdigest()[:12]}"


QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def pre_tokenizer_of(model: Path) -> str:
    """The llama.cpp pre-tokenizer whose split matches the checkpoint's tokenizer.json, for a tokenizer whose hash
    the converter does not know. A bare ByteLevel pre-tokenizer with use_regex (ours: leverlab/train/tokenizer.py)
    splits with GPT-2's regex, llama.cpp's "gpt-2"; a Split on Qwen2's regex is "qwen2"."""
    tok = json.loads((model / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    for s in steps:
        if s.get("type") == "Split" and s.get("pattern", {}).get("Regex") == QWEN2_SPLIT:
            return "qwen2"
    raise PeerError(f"no llama.cpp pre-tokenizer known to match {model / 'tokenizer.json'}'s {pre.get('type')}; "
                    "pass --pre-tokenizer NAME (a name llama.cpp's llama-vocab.cpp accepts)")


def _torch_constraint(tmp: Path) -> Path:
    """A pip constraints file pinning the installed torch: an install that would change it fails instead."""
    from importlib.metadata import version

    c = tmp / "constraints.txt"
    c.write_text(f"torch=={version('torch')}\n")
    return c


def convert(model: Path, root: Path, bins: dict[str, Path], precisions: list[str], pre: str | None) -> dict:
    """{precision: GGUF path}: bf16 by the converter, Q8_0 / Q4_0 by llama-quantize from it; cached per model."""
    out_dir = root / "gguf" / model_key(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {p: out_dir / f"model-{GGUF_TYPES[p].lower()}.gguf" for p in precisions}
    bf16 = out_dir / "model-bf16.gguf"
    if not bf16.exists():
        pre = pre or pre_tokenizer_of(model)
        src = source_dir(root)
        log = out_dir / "convert.log"
        log.unlink(missing_ok=True)
        print(f"llama.cpp: converting {model} to GGUF bf16 with {src / 'convert_hf_to_gguf.py'}; its tokenizer "
              f"hash is unknown to the converter, so it is mapped to llama.cpp's {pre!r} pre-tokenizer "
              f"(by a wrapper; llama.cpp's files are not edited)", flush=True)
        tmp_out = bf16.with_suffix(".tmp")
        cmd = [sys.executable, "-m", "leverlab.bench.peer_llamacpp", "convert", "--src", src, "--pre", pre,
               model, tmp_out]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
        for attempt in range(3):  # installs at most two missing modules the converter asks for
            try:
                _run(cmd, log, env=env)
                break
            except PeerError:
                m = re.findall(r"No module named '([\w.]+)'", tail(log, 60))
                if not m or attempt == 2:
                    raise
                mod = m[-1].split(".")[0]
                print(f"llama.cpp: the converter needs the Python module {mod!r}: installing it from PyPI "
                      f"into {sys.prefix} (torch pinned)", flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    _run([sys.executable, "-m", "pip", "install", "-c", _torch_constraint(Path(tmp)),
                          {"yaml": "pyyaml"}.get(mod, mod)], out_dir / "pip.log")
        tmp_out.rename(bf16)
    for p, path in paths.items():
        if not path.exists():
            print(f"llama.cpp: llama-quantize bf16 -> {GGUF_TYPES[p]}", flush=True)
            _run([bins["llama-quantize"], bf16, path.with_suffix(".tmp"), GGUF_TYPES[p]], out_dir / "quantize.log")
            path.with_suffix(".tmp").rename(path)
    return paths


def gguf_weight_bytes(path: Path, root: Path, experts_only: bool = False) -> int:
    """Bytes of every tensor in a GGUF file, as stored (quantization blocks and their scales included): what one
    decode step reads, the tied output head being the embedding matrix itself. experts_only: a mixture of experts'
    routed experts only (llama.cpp stacks them in the `*_exps` tensors), of which a step reads those it hits."""
    sys.path.insert(0, str(source_dir(root) / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if not experts_only or "_exps" in t.name)


def _convert_main(argv: list[str]) -> int:
    """The converter with one change, made in this process only: a tokenizer hash the converter does not know
    gets the pre-tokenizer named by --pre instead of an error."""
    import argparse

    ap = argparse.ArgumentParser(prog="peer_llamacpp convert")
    ap.add_argument("--src", required=True)
    ap.add_argument("--pre", required=True)
    ap.add_argument("--outtype", default="bf16", help="the converter's --outtype (f32, f16, bf16, q8_0)")
    ap.add_argument("model")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    src = Path(a.src)
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print(f"peer_llamacpp: unknown pre-tokenizer hash -> {a.pre!r}", flush=True)
            return a.pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    import runpy

    sys.argv = ["convert_hf_to_gguf.py", a.model, "--outtype", a.outtype, "--outfile", a.out]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


def _build_main(argv: list[str]) -> int:
    """The one install step for the study's llama.cpp engine: the binaries built into the cache."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m leverlab.bench.peer_llamacpp build")
    ap.add_argument("--dir", default=None, help=f"build + GGUF cache (default $LEVERLAB_CACHE/llamacpp/{VERSION})")
    ap.add_argument("--jobs", type=int, default=None, help="build jobs (default: all cores)")
    a = ap.parse_args(argv)
    try:
        bins = ensure_built(Path(a.dir).expanduser() if a.dir else default_dir(), a.jobs)
    except PeerError as e:
        print(f"llama.cpp: {e}", file=sys.stderr)
        return 2
    print(f"llama-server: {bins['llama-server']}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["convert"]:
        sys.exit(_convert_main(sys.argv[2:]))
    if sys.argv[1:2] == ["build"]:
        sys.exit(_build_main(sys.argv[2:]))
    sys.exit(f"usage: python -m leverlab.bench.peer_llamacpp build | convert ...\n{__doc__}")
