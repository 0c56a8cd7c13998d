"""A GGUF file (llama.cpp's single-file format) as a model source: its metadata read as the config.json it came
from, its end-of-sequence ids and chat template. The `gguf` package (llama.cpp's own reader, on PyPI) parses the
file; the tensors are read in gguf_loader.py.

The metadata keys are llama.cpp's (`{arch}.block_count`, `{arch}.attention.head_count`, ...). Three of its
architectures are ours: qwen3, qwen2 and llama (llama.cpp writes Mistral as llama too, without its sliding
window, which llama.cpp does not apply either).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

# GGUF general.architecture -> our (Hugging Face) architecture name
GGUF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a GGUF file (by its magic bytes, whatever its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def reader(path: str | Path):
    """The file's GGUFReader (memory-mapped; cached, since the config, the tokenizer's eos and the weights all
    read it and parsing a 150k-token vocabulary's metadata takes a while)."""
    p = Path(path).resolve()
    return _reader(str(p), p.stat().st_mtime_ns)


@lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:  # a truncated or foreign file: say which and why
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def field(r, key: str, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def _f32(v: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07): the
    config.json value it was written from."""
    return float(str(np.float32(v)))


def hf_config(path: str | Path) -> dict:
    """The file's metadata as a config.json dict (the keys ModelConfig reads), plus `eos_token_id` (a list)."""
    r = reader(path)
    arch = field(r, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF {path}: architecture {arch!r} is not supported; supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")

    def key(name: str, default=None, required: bool = True):
        v = field(r, f"{arch}.{name}", default)
        if v is None and required:
            raise ValueError(f"GGUF {path}: metadata key {arch}.{name} is missing")
        if isinstance(v, list):  # per-layer values (some models vary heads by layer): ours are uniform
            if len(set(v)) != 1:
                raise ValueError(f"GGUF {path}: {arch}.{name} varies by layer ({v[:4]}...), which our decoder "
                                 "does not support")
            v = v[0]
        return v

    tensors = {t.name: t for t in r.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF {path} has no token_embd.weight")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {path}: key and value head sizes differ, which our decoder does not support")
    rot = key("rope.dimension_count", None, required=False)
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"GGUF {path}: rotary embedding on {rot} of {head_dim} head dims (partial rotary) "
                         "is not supported")
    theta = _f32(key("rope.freq_base", 10000.0))
    raw = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(r, arch, tensors, path, theta, head_dim),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "eos_token_id": eos_ids(r),
    }
    return raw


def eos_ids(r) -> list[int]:
    """End ids from the tokenizer metadata: eos, then end-of-turn and end-of-message where the file names them
    (llama.cpp stops on all of them, as our engine does on generation_config.json's list)."""
    ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = field(r, f"tokenizer.ggml.{name}")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return ids


def chat_template(path: str | Path) -> str | None:
    return field(reader(path), "tokenizer.chat_template")


def _rope_scaling(r, arch: str, tensors: dict, path, theta: float, head_dim: int) -> dict | None:
    """rope_scaling as config.json has it. llama.cpp writes linear / yarn scaling as keys; Llama 3's scaling it
    writes only as its result, a `rope_freqs` tensor of per-frequency divisors. That tensor is matched against
    Llama 3's formula at the parameters every Llama 3.x release uses, then at other ramps and original lengths
    (powers of two); a tensor that none reproduces is refused, not guessed."""
    kind = field(r, f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        # Llama 3.x: low 1, high 4, original context 8192; other ramps and powers of two tried after it
        ramps = [(1.0, 4.0)] + [(lo, hi) for lo in (1.0, 2.0) for hi in (2.0, 4.0, 8.0) if (lo, hi) != (1.0, 4.0)]
        for lo, hi in ramps:
            for orig in [8192] + [2**k for k in range(4, 21) if k != 13]:
                cand = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": lo,
                        "high_freq_factor": hi, "original_max_position_embeddings": orig}
                if np.allclose(_llama3_factors(cand, theta, head_dim), factors, rtol=1e-6, atol=0):
                    return cand
        raise ValueError(f"GGUF {path}: its rope_freqs tensor (per-frequency RoPE divisors) matches no Llama 3 "
                         "scaling we know; serve the Hugging Face folder instead")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(field(r, f"{arch}.rope.scaling.factor", 1.0))}
    orig = field(r, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling  # ModelConfig accepts the kinds our rotary implements and refuses the others by name


def _llama3_factors(s: dict, theta: float, dim: int) -> np.ndarray:
    """The rope_freqs divisors llama.cpp's converter writes for Llama 3 scaling `s` (its formula, from the paper's
    definition: 1 for short wavelengths, `factor` for long ones, a smooth ramp between)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    lo_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    hi_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)
