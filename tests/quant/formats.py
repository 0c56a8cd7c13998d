"""Small pre-quantized checkpoints made by the tests themselves, in the AWQ and GPTQ layouts.

The packers here are written independently of leverlab.quant (plain loops over nibbles, as AutoAWQ and
AutoGPTQ pack), so a loader that unpacks wrongly cannot agree with them by sharing a bug.
`write_quantized(src, dst, fmt)` returns {checkpoint weight name: the float32 [out, in] weight it encodes}.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def rtn(w: torch.Tensor, g: int, sym: bool = False):
    """Round-to-nearest 4-bit per group: q [out, in] int64, scales [out, in/g], zeros [out, in/g] int64."""
    out, k = w.shape
    wg = w.double().reshape(out, k // g, g)
    if sym:
        scales = wg.abs().amax(-1) / 7.0
        zeros = torch.full_like(scales, 8)
    else:
        scales = (wg.amax(-1) - wg.amin(-1)) / 15.0
        zeros = torch.round(-wg.amin(-1) / scales).clamp(0, 15)
    q = (torch.round(wg / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return q.reshape(out, k).long(), scales.float(), zeros.long()


def encoded(q, scales, zeros, g):
    """What a checkpoint of fp16 scales encodes, in float32."""
    s = scales.half().float().repeat_interleave(g, 1)
    return (q.float() - zeros.float().repeat_interleave(g, 1)) * s


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(mat: torch.Tensor) -> torch.Tensor:
    """[r, c] 4-bit ints -> int32 [r, c/8], columns interleaved in the AWQ order (AutoAWQ's loop)."""
    r, c = mat.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for col in range(c // 8):
        for i in range(8):
            out[:, col] |= mat[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
    return _to_int32(out)


def gptq_pack_rows(mat: torch.Tensor) -> torch.Tensor:
    """[r, c] -> int32 [r/8, c], rows 8j..8j+7 in nibbles 0..7 (AutoGPTQ's loop)."""
    r, c = mat.shape
    out = torch.zeros(r // 8, c, dtype=torch.int64)
    for row in range(r // 8):
        for j in range(8):
            out[row] |= mat[row * 8 + j] << (4 * j)
    return _to_int32(out)


def gptq_pack_cols(mat: torch.Tensor) -> torch.Tensor:
    r, c = mat.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for col in range(c // 8):
        for j in range(8):
            out[:, col] |= mat[:, col * 8 + j] << (4 * j)
    return _to_int32(out)


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def write_quantized(src: str | Path, dst: str | Path, fmt: str, group_size: int = 32, act_order: bool = False,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Write `dst`, `src` quantized in `fmt` ("awq" or "gptq"); returns the weights it encodes."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors, ref = {}, {}
    source = _tensors(src)
    for name, w in source.items():
        base, _, kind = name.rpartition(".")
        if kind != "weight" or base.rpartition(".")[2] not in PROJ:
            tensors[name] = w.contiguous()
            continue
        g = group_size
        if fmt == "awq":
            q, s, z = rtn(w, g)
            tensors[f"{base}.qweight"] = awq_pack(q.t().contiguous())
            tensors[f"{base}.qzeros"] = awq_pack(z.t().contiguous())
            tensors[f"{base}.scales"] = s.t().contiguous().half()
            ref[name] = encoded(q, s, z, g)
        else:
            k = w.shape[1]
            # act-order: each input channel's group is a random permutation of the plain i // g, the same for
            # projections that read the same input (GPTQ orders by that input's Hessian diagonal)
            reads = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
            leaf = base.rpartition(".")[2]
            gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{base.rpartition('.')[0]}/{reads.get(leaf, leaf)}".encode()))
            g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)] if act_order else torch.arange(k) // g
            # quantize with the channels sorted by group, then scatter back to checkpoint order
            perm = torch.argsort(g_idx, stable=True)
            q_sorted, s, z = rtn(w[:, perm], g, sym=True)  # GPTQ's usual sym=True: zeros 8
            q = torch.empty_like(q_sorted)
            q[:, perm] = q_sorted
            tensors[f"{base}.qweight"] = gptq_pack_rows(q.t().contiguous())
            tensors[f"{base}.qzeros"] = gptq_pack_cols((z - 1).t().contiguous())  # v1: zero - 1
            tensors[f"{base}.scales"] = s.t().contiguous().half()
            tensors[f"{base}.g_idx"] = g_idx.to(torch.int32)
            if f"{base}.bias" not in source:  # AutoGPTQ writes zero biases for bias-free projections
                tensors[f"{base}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
            s_full = s.half().float()[:, g_idx]
            z_full = z.float()[:, g_idx]
            ref[name] = (q.float() - z_full) * s_full
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if fmt == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                      "desc_act": act_order, "sym": True}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref


def write_float(src: str | Path, dst: str | Path, weights: dict[str, torch.Tensor]) -> Path:
    """A float32 copy of `src` with `weights` replaced (the fake-quantized reference model)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors = _tensors(src)
    tensors.update(weights)
    cfg = json.loads((dst / "config.json").read_text())
    if "lm_head.weight" in weights and cfg.get("tie_word_embeddings"):
        # a quantized head of a tied model: the reference keeps the float embedding and its own head
        cfg["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst
