"""compressed-tensors checkpoints written by the `compressed-tensors` package itself, from a tiny checkpoint.

The flow llm-compressor runs, without llm-compressor (which pins its own torch): apply_quantization_config
attaches a scheme to each targeted Linear, the weights' scales (and zero points) come from calculate_qparams
over each channel's / group's / block's min and max (llm-compressor's min-max observer; the tests need a valid
checkpoint, not a calibrated one), then ModelCompressor compresses the model in the requested format and writes
the config. The model is loaded in bfloat16 first, as the published releases are (their scales are bf16).

`reference(path, name)` dequantizes one checkpoint module with the package's own compressor: the weight the
format says that module holds, in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open

SCHEMES = {  # the presets of the releases this reads
    "w8a8": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                 input_activations=dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
    "w8a16": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    "w4a16": dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)),
    "w4a16-asym": dict(weights=dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
    "fp8-channel": dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                        input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="token",
                                               dynamic=True)),
    "fp8-block": dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="block",
                                   block_structure=[128, 128]),
                      input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="group",
                                             group_size=128, dynamic=True)),
}
FORMATS = {"w8a8": "int-quantized", "w8a16": "pack-quantized", "w4a16": "pack-quantized",
           "w4a16-asym": "pack-quantized", "fp8-channel": "float-quantized", "fp8-block": "float-quantized"}


def _min_max(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = w.unflatten(1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "block":
        br, bc = args.block_structure
        w = F.pad(w, (0, -w.shape[1] % bc, 0, -w.shape[0] % br))  # zeros: min/max are taken with 0 anyway
        b = w.unflatten(0, (-1, br)).unflatten(2, (-1, bc))
        return b.amin((1, 3)), b.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def write_ct(src: str | Path, dst: str | Path, scheme: str | dict, fmt: str | None = None,
             ignore: tuple[str, ...] = ("lm_head",), targets: tuple[str, ...] = ("Linear",)) -> Path:
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    spec = SCHEMES[scheme] if isinstance(scheme, str) else scheme
    fmt = fmt or FORMATS[scheme]
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    qs = QuantizationScheme(targets=list(targets), **{k: QuantizationArgs(**v) for k, v in spec.items()})
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qs}, ignore=list(ignore)),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            s = getattr(module, "quantization_scheme", None)
            if s is None:
                continue
            scale, zp = calculate_qparams(*_min_max(module.weight.float(), s.weights), s.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zp.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return dst


def tensors(path: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of module `prefix`, under their local names (weight_scale, ...)."""
    out = {}
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                if k.rpartition(".")[0] == prefix:
                    out[k.rpartition(".")[2]] = f.get_tensor(k)
    return out


def scheme_of(path: str | Path) -> tuple[QuantizationScheme, str]:
    qcfg = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    return QuantizationScheme(**{k: v for k, v in group.items() if k != "format"}), group.get("format") or qcfg["format"]


def reference(path: str | Path, prefix: str) -> torch.Tensor:
    """Module `prefix`'s weight [out, in] float32, as the package's own compressor decompresses it."""
    scheme, fmt = scheme_of(path)
    # float32 scales: the package dequantizes in the scales' dtype, which would round the reference to bf16
    state = {k: v.float() if v.dtype in (torch.bfloat16, torch.float16) else v
             for k, v in tensors(path, prefix).items()}
    state = BaseCompressor.get_value_from_registry(fmt).decompress(state, scheme)
    return state["weight"].float()
