"""GGUF files for the tests, written by llama.cpp's own converter from the tests' tiny checkpoints.

The converter (convert_hf_to_gguf.py, with its bundled gguf-py) comes from the llama.cpp source that the peer
benchmark unpacks from llama-cpp-python's sdist (leverlab/bench/peer_llamacpp.py); on a machine without it the
sdist is fetched from PyPI once (about 75 MB, no build: converting needs only Python). Where it cannot be had,
the tests that need it skip, naming why. Q4_0 needs llama.cpp's C++ llama-quantize, which tests never build:
write_q4_0 quantizes a converted F32 file's projections with the gguf package's own Q4_0 quantizer instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.")


def convert(model: Path, out: Path, outtype: str) -> Path:
    """`model` (a Hugging Face folder) -> `out`, a GGUF file of `outtype` (f32, f16, bf16, q8_0) by llama.cpp's
    converter, run as peer_llamacpp runs it (its tokenizer-hash wrapper included)."""
    from leverlab.bench import peer_llamacpp as peer

    try:
        src = peer.source_dir(peer.default_dir())
    except (peer.PeerError, OSError) as e:
        pytest.skip(f"llama.cpp's converter (llama-cpp-python {peer.VERSION} sdist) is not installed here and "
                    f"could not be fetched: {e}")
    cmd = [sys.executable, "-m", "leverlab.bench.peer_llamacpp", "convert", "--src", str(src),
           "--pre", peer.pre_tokenizer_of(model), "--outtype", outtype, str(model), str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        missing = re.findall(r"No module named '([\w.]+)'", r.stdout + r.stderr)
        if missing:
            pytest.skip(f"llama.cpp's converter needs the Python module {missing[-1]!r}, not installed here")
        raise AssertionError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return out


def write_q4_0(f32_gguf: Path, out: Path) -> Path:
    """A copy of a converted F32 GGUF whose decoder projections are Q4_0 (the gguf package's quantizer), every
    other tensor and all metadata as they are."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    r = GGUFReader(str(f32_gguf))
    w = GGUFWriter(str(out), arch=r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name.startswith("blk.") and any(p in t.name for p in PROJECTIONS) and t.name.endswith(".weight"):
            w.add_tensor(t.name, quantize(data, GGMLQuantizationType.Q4_0), raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
