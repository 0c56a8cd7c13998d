"""`leverlab quantize SRC DST --method int8|int4|awq|w8a8`: write a quantized checkpoint folder once, so that
`leverlab serve DST` loads it without re-quantizing (config.json carries a quantization_config).

Works tensor by tensor on the checkpoint itself (no model is built): each decoder projection
(q/k/v/o/gate/up/down_proj .weight) becomes its method's tensors; everything else - embeddings, norms, the
output head - is copied unchanged, as AWQ/GPTQ checkpoints keep them.

Layouts written:
  int8  qweight int8 [out, in] + scales [out] (per-channel symmetric); quant_method "int8" (ours).
  int4  the AutoAWQ GEMM layout (qweight/qzeros/scales, see awq.py), group 64 unless --group-size;
        quant_method "awq", so vLLM / transformers read it as well.
  awq   the same layout and math with AutoAWQ's default group 128. The weights are round-to-nearest: AWQ's
        activation-aware scale search needs calibration data and is not built, so this is an AWQ *format*
        checkpoint, not an AWQ-*calibrated* one.
  w8a8  compressed-tensors W8A8 int8 (quant/compressed_tensors.py): our int8's weights in the format vLLM and
        llm-compressor use, so vLLM's CPU build can be measured at 8 bits; an export for other engines.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from leverlab.quant.base import QUANTIZED_PROJECTIONS

METHODS = ("int8", "int4", "awq", "w8a8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="Hugging Face model folder with bf16/fp16/fp32 weights")
    p.add_argument("dst", help="output folder (created; must not exist unless --overwrite)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--group-size", type=int, default=None, help="int4/awq group size (default 64 / 128)")
    p.add_argument("--overwrite", action="store_true")


def make_method(method: str, group_size: int | None):
    if method == "int8":
        from leverlab.quant.int8 import Int8Method

        return Int8Method()
    if method == "w8a8":
        from leverlab.quant.compressed_tensors import W8A8Export

        return W8A8Export()
    from leverlab.quant.awq import AWQMethod

    return AWQMethod(group_size or (64 if method == "int4" else 128))


# Mixtral's expert projections (w1 gate, w3 up, w2 down): quantized as the other architectures' gate/up/down.
MIXTRAL_EXPERT_PROJECTIONS = ("w1", "w2", "w3")
# Expert weights stacked per layer into one 3D tensor (models/loader.py: STACKED_EXPERTS).
STACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def is_quantized_weight(name: str) -> bool:
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    return kind == "weight" and module.startswith("model.layers.") and (
        leaf in QUANTIZED_PROJECTIONS or (leaf in MIXTRAL_EXPERT_PROJECTIONS and ".experts." in module))


def quantize_folder(src: str | Path, dst: str | Path, method: str, group_size: int | None = None,
                    overwrite: bool = False) -> Path:
    from safetensors.torch import save_file

    from leverlab.models.loader import checkpoint_files, open_checkpoint

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({cfg['quantization_config'].get('quant_method')})")
    files = checkpoint_files(src)
    for file in files:  # before anything is written
        with open_checkpoint(file) as f:
            stacked = [n for n in f.keys() if n.endswith(STACKED_EXPERTS)]
        if stacked:  # written as float they would not load beside quantized experts
            raise ValueError(f"{src}: {stacked[0]} holds all experts in one stacked tensor, which `leverlab "
                             "quantize` does not split; quantize at load time instead (--quantization)")
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    qm = make_method(method, group_size)
    weight_map = {}
    for file in files:
        out = {}
        with open_checkpoint(file) as f:  # safetensors, or a *.bin (written out as safetensors)
            for name in f.keys():
                tensor = f.get_tensor(name)
                if is_quantized_weight(name):
                    base = name.rpartition(".")[0]
                    for suffix, t in qm.export(tensor).items():
                        out[f"{base}.{suffix}"] = t.contiguous()
                else:
                    out[name] = tensor.contiguous()
        name = file.with_suffix(".safetensors").name
        save_file(out, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in out})
    skip = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    for f in src.iterdir():  # tokenizer, generation config, README...
        if f.is_file() and f.suffix not in (".safetensors", ".bin") and f.name not in skip:
            shutil.copy(f, dst / f.name)
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    qcfg = qm.config_dict()
    qcfg["leverlab"] = {"method": method, "algorithm": "round-to-nearest"}
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    dst = quantize_folder(args.src, args.dst, args.method, args.group_size, args.overwrite)
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    src_size = sum(f.stat().st_size for f in Path(args.src).glob("*.safetensors"))
    print(f"wrote {dst} ({args.method}): {size / 2**20:.1f} MiB of weights (from {src_size / 2**20:.1f} MiB) "
          f"in {time.monotonic() - t0:.1f} s; serve it with `leverlab serve {dst}`")
    return 0
