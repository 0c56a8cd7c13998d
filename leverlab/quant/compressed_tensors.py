"""compressed-tensors checkpoints (the format llm-compressor writes: RedHatAI's and Neural Magic's INT8 W8A8, INT4
W4A16 and FP8 releases, which vLLM loads natively), read onto our kernels, and our int8 written in it.

Reading. The `compressed-tensors` package parses `quantization_config` (QuantizationConfig: config groups of
targets and schemes, the ignore list, the format) and matches layers to groups (is_match: a class name such as
"Linear", a module name, or "re:" a regular expression); nothing of the format is parsed by hand here. Each
group's scheme becomes one layer method of ct_schemes.py, and CompressedTensorsMethod.for_layer gives every
layer its group's method (None: ignored, left in the model dtype). What we read:
  int8 weights, per channel, symmetric (int-quantized / naive-quantized / pack-quantized): W8A8 with dynamic per-token symmetric
       activations onto int8.py's kernels; W8A16 (no activations) onto its weight-only path
  int4 weights, group-wise (group 32/64/128/256), symmetric or with zero points (pack-quantized), no activation
       quantization (W4A16) onto int4.py's kernels
  fp8 e4m3 weights per channel, per tensor or per block (float-quantized), activations none or dynamic: stored
       as e4m3 and widened in the matmul on the CPU, as fp8.py does
Everything else the format can say is refused at load with a message naming it: static activation scales
(input_scale), asymmetric or per-group activations, output activations, KV-cache scales (kv_cache_scheme: use
--kv-cache-dtype), sparsity (2:4 and others), transforms, act-order g_idx, other bit widths and formats, a
quantized output head, packed q/k/v or gate/up parts in different groups, and a group that targets no layer
we have.

Writing. `leverlab quantize SRC DST --method w8a8` writes our int8 in this format (W8A8Export), for vLLM's CPU
build (CPUInt8ScaledMMLinearKernel), where its on-the-fly fp8 does not run (docs/bench.md has the error it gives).
The math is our int8's: per-output-channel symmetric weights, round to nearest (quant/layouts.py quantize_int8),
and activations quantized per token at run time. The tensors keep their names (`...q_proj.weight` becomes int8)
beside a `weight_scale` [out, 1] in float32; the output head is left as it is (listed under "ignore"). Read back,
the int8 values and scales are int8.py's own, bit for bit.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.utils.match import is_match, match_name
from pydantic import ValidationError

from leverlab.errors import UnsupportedLever
from leverlab.quant.base import QuantMethod
from leverlab.quant.ct_schemes import CTFP8Method, CTInt4Method, CTInt8Method
from leverlab.quant.layouts import INT4_GROUP_SIZES, quantize_int8

NAME = "compressed-tensors"
# quantization_config keys besides QuantizationConfig's own fields: what the writers add around it.
_INFORMATIONAL = {"version", "quant_method", "leverlab"}  # leverlab: what `leverlab quantize` ran
_EMPTY_ONLY = {"sparsity_config": "sparsity (e.g. 2:4)", "transform_config": "transforms (rotations such as "
               "SpinQuant / QuIP)"}


def _refuse(what: str) -> UnsupportedLever:
    return UnsupportedLever(f"compressed-tensors checkpoint: {what} is not supported")


class CompressedTensorsMethod(QuantMethod):
    """The checkpoint's config: hands each layer its group's method (for_layer); never runs a layer itself."""

    name = NAME

    def __init__(self, config: QuantizationConfig, methods: dict[str, QuantMethod]):
        self.config = config
        self.methods = methods  # config group name -> its layer method
        self.matched: set[str] = set()  # groups some layer took (the rest target layer kinds we do not have)

    @property
    def families(self) -> set[str]:
        """--quantization values that name what this checkpoint holds (int8, int4, fp8)."""
        return {n for m in self.methods.values() for n in (m.name, m.name.split("-")[0])}

    @classmethod
    def from_checkpoint_config(cls, qcfg: dict) -> CompressedTensorsMethod:
        qcfg = dict(qcfg)
        for key, what in _EMPTY_ONLY.items():
            if qcfg.pop(key, None):
                raise _refuse(f"{key} ({what})")
        unknown = set(qcfg) - set(QuantizationConfig.model_fields) - _INFORMATIONAL
        if unknown:
            raise _refuse(f"quantization_config field(s) {', '.join(sorted(unknown))}")
        try:
            config = QuantizationConfig.model_validate(qcfg)
        except (ValidationError, ValueError, NotImplementedError) as e:
            raise ValueError(f"compressed-tensors quantization_config does not parse: {e}") from e
        if config.kv_cache_scheme is not None:
            raise _refuse("kv_cache_scheme (KV-cache quantization scales; use --kv-cache-dtype int8 or fp8)")
        if config.quantization_status != "compressed":
            status = getattr(config.quantization_status, "value", config.quantization_status)
            raise _refuse(f"quantization_status {status!r} (only compressed checkpoints)")
        methods = {name: scheme_method(name, scheme, scheme.format or config.format)
                   for name, scheme in config.config_groups.items()}
        return cls(config, methods)

    def for_layer(self, parts: list[str], module) -> QuantMethod | None:
        """The method of the group that targets this layer's checkpoint modules `parts` (q/k/v of a packed
        qkv layer), None where ignore lists them or no group targets them."""
        groups = {self._group(name, module) for name in parts}
        if len(groups) > 1:
            raise _refuse(f"{', '.join(parts)} in different groups ({sorted(map(str, groups))}); we pack them into "
                          f"one layer")
        group = groups.pop()
        if group is not None and parts == ["lm_head"]:
            raise _refuse(f"a quantized output head (lm_head in group {group}; ignore lists it in most releases)")
        if group is None:
            return None
        self.matched.add(group)
        return self.methods[group]

    def _group(self, name: str, module) -> str | None:
        ignore = self.config.ignore or []
        found = [g for g, s in self.config.config_groups.items() if is_match(name, module, s.targets, ignore)]
        if len(found) > 1:  # as vLLM: a target naming the module wins over one naming its class
            by_name = [g for g in found if any(match_name(name, t) for t in self.config.config_groups[g].targets)]
            found = by_name if len(by_name) == 1 else found
        if len(found) > 1:
            raise _refuse(f"{name} matched by several groups ({', '.join(found)})")
        return found[0] if found else None

    def attached(self) -> None:
        """After every layer asked: a group no layer took targets a layer kind we do not have."""
        for group in self.methods.keys() - self.matched:
            raise _refuse(f"group {group} (targets {self.config.config_groups[group].targets}): no layer of this "
                          "model matches, so its weights would not load")

    def config_dict(self) -> dict:
        return self.config.model_dump(mode="json")


def scheme_method(group: str, scheme: QuantizationScheme, fmt: str) -> QuantMethod:
    """The layer method for one config group, or a refusal naming what it asks for that we do not build."""
    w, a = scheme.weights, scheme.input_activations
    where = f"group {group}"
    if w is None:
        raise _refuse(f"{where}: activation-only quantization (no weights)")
    if scheme.output_activations is not None:
        raise _refuse(f"{where}: output_activations")
    if w.dynamic:
        raise _refuse(f"{where}: dynamic weights")
    if w.actorder == "group":
        raise _refuse(f"{where}: actorder group (a g_idx permutation of the inputs)")
    if a is not None:
        if a.dynamic is not True:
            raise _refuse(f"{where}: static activation scales (input_activations dynamic={a.dynamic}: input_scale)")
        if not a.symmetric:
            raise _refuse(f"{where}: asymmetric activations")
        if (a.type, a.num_bits) != (w.type, w.num_bits):
            raise _refuse(f"{where}: {a.type}{a.num_bits} activations with {w.type}{w.num_bits} weights")
    kind = f"{w.type}{w.num_bits}"
    if kind == "int8":
        if fmt not in ("int-quantized", "naive-quantized", "pack-quantized"):
            raise _refuse(f"{where}: int8 weights in format {fmt}")
        if w.strategy != "channel" or not w.symmetric:
            raise _refuse(f"{where}: int8 weights {w.strategy}, symmetric={w.symmetric} (per-channel symmetric "
                          f"only)")
        if a is not None and a.strategy != "token":
            raise _refuse(f"{where}: int8 activations per {a.strategy} (per token only)")
        return CTInt8Method(activations=a is not None, packed=fmt == "pack-quantized")
    if kind == "int4":
        if fmt != "pack-quantized":
            raise _refuse(f"{where}: int4 weights in format {fmt}")
        if w.strategy != "group" or w.group_size not in INT4_GROUP_SIZES:
            raise _refuse(f"{where}: int4 weights {w.strategy} group_size={w.group_size} (group-wise, a group "
                          f"of {'/'.join(map(str, INT4_GROUP_SIZES))} only)")
        if a is not None:
            raise _refuse(f"{where}: {a.type}{a.num_bits} activations with int4 weights (W4A16 only)")
        return CTInt4Method(w.group_size, symmetric=w.symmetric)
    if kind == "float8":
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"{where}: fp8 weights in format {fmt}")
        if not w.symmetric:
            raise _refuse(f"{where}: asymmetric fp8 weights")
        if w.strategy not in ("channel", "tensor", "block"):
            raise _refuse(f"{where}: fp8 weights per {w.strategy}")
        # Dynamic activations per token, tensor or group (the block preset's 128): a GPU matter (fp8.py quantizes
        # per token there, finer than per tensor); the CPU multiplies float activations.
        if a is not None and a.strategy not in ("token", "tensor", "group"):
            raise _refuse(f"{where}: fp8 activations per {a.strategy}")
        block = tuple(w.block_structure) if w.strategy == "block" else None
        return CTFP8Method(w.strategy, block)
    raise _refuse(f"{where}: {kind} weights")


class W8A8Export:
    name = "w8a8"

    def export(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales = quantize_int8(weight)
        return {"weight": q, "weight_scale": scales[:, None].float()}

    def config_dict(self) -> dict:
        int8 = {"num_bits": 8, "type": "int", "symmetric": True}
        return {
            "quant_method": NAME,
            "format": "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**int8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**int8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
