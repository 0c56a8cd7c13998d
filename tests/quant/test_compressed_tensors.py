"""compressed-tensors checkpoints written by the `compressed-tensors` package itself (tests/quant/ct_writer.py)
load onto our int8 / int4 / fp8 methods: every layer computes what the package's own dequantization says (W8A8
with its per-token activation quantization), the engine generates from each, and what we do not build is
refused by name."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.errors import UnsupportedLever
from leverlab.layers.linear import Linear
from leverlab.models.decoder import CausalLM
from leverlab.models.loader import load_model
from tests.quant import ct_writer as ct
from tests.quant.formats import write_float

# A model whose every input width is a multiple of 128 (FP8 blocks, int4 group 128); k/v are 64 rows, so a
# 128-row block straddles the packed qkv layer's shards.
SHAPE = dict(hidden_size=128, intermediate_size=256)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
METHODS = {"w8a8": "CTInt8Method", "w8a16": "CTInt8Method", "w4a16": "CTInt4Method", "w4a16-asym": "CTInt4Method",
           "w4a16-g128": "CTInt4Method", "fp8-channel": "FP8CheckpointMethod", "fp8-block": "FP8CheckpointMethod"}


@pytest.fixture(scope="module")
def source(checkpoint_factory, tmp_path_factory):
    """A float32 checkpoint whose weights are bf16 numbers (as the published releases start from), so that the
    writer's bf16 load and a float32 reference model hold the same values."""
    from transformers import AutoModelForCausalLM

    src = checkpoint_factory("qwen3", **SHAPE)
    dst = tmp_path_factory.mktemp("bf16src")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).float()
    model.save_pretrained(str(dst))
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    made = {}

    def get(scheme: str):
        if scheme not in made:
            spec = ct.SCHEMES.get(scheme)
            if scheme == "w4a16-g128":
                spec = {"weights": {**ct.SCHEMES["w4a16"]["weights"], "group_size": 128}}
            made[scheme] = ct.write_ct(source, tmp_path_factory.mktemp(scheme), spec,
                                       ct.FORMATS.get(scheme, "pack-quantized"))
        return made[scheme]

    return get


def parts_of(name: str) -> list[tuple[str, str | None]]:
    parent, _, leaf = name.rpartition(".")
    parts = [(f"{parent}.{ck}", shard) for ck, (ours, shard) in CausalLM.PACKED.items() if ours == leaf]
    return parts or [(name, None)]


def reference_weights(path, model) -> dict[str, torch.Tensor]:
    """checkpoint name -> the float32 weight the package's own compressor decompresses it to."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.quant_method is not None:
            for part, _ in parts_of(name):
                out[f"{part}.weight"] = ct.reference(path, part)
    return out


@pytest.mark.parametrize("scheme", list(METHODS))
def test_every_layer_matches_the_packages_dequantized_reference(written, scheme):
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    path = written(scheme)
    qs, _ = ct.scheme_of(path)
    model = load_model(path, "float32")
    assert model.quant_method.name == "compressed-tensors"
    assert model.lm_head.quant_method is None  # ignored by the checkpoint: the model dtype, as vLLM keeps it
    torch.manual_seed(0)
    n = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or name == "lm_head":
            continue
        assert type(layer.quant_method).__name__ == METHODS[scheme], name
        w = torch.cat([ct.reference(path, part) for part, _ in
                       sorted(parts_of(name), key=lambda p: layer.shards[p[1]][0] if p[1] else 0)])
        x = torch.randn(5, layer.in_features)
        xr = x
        if scheme == "w8a8":  # the format's dynamic per-token activations, by the package's own functions
            # [batch, tokens, hidden], as the package expects activations (per token: over the last dim)
            scale, zp = compute_dynamic_scales_and_zp(x[None], qs.input_activations, module=None)
            xr = fake_quantize(x[None], scale, zp, qs.input_activations)[0]
            assert not torch.equal(xr, x)
        with torch.no_grad():
            y = layer(x)
        ref = xr @ w.t()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), name
        assert torch.equal(layer.quant_method.dequantize(layer), w), name  # the weight itself: bit for bit
        n += 1
    assert n == 4 * model.config.num_layers


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16-asym", "fp8-block"])
def test_engine_generates_like_a_float_model_of_the_dequantized_weights(written, source, tmp_path, scheme):
    """Weight-only schemes in float32: greedy tokens through the whole engine equal those of a float checkpoint
    holding the package's dequantized weights."""
    path = written(scheme)
    llm = LLM(str(path), dtype="float32")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    ref = write_float(source, tmp_path / "fake", reference_weights(path, llm.engine.runner.model))
    assert got == [o.outputs[0].token_ids for o in LLM(str(ref), dtype="float32").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("scheme", list(METHODS))
def test_engine_generates_from_each_checkpoint_in_bf16(written, scheme):
    """bfloat16 takes the kernels (int8 streaming / int8 GEMM, int4 streaming, fp8 widened): greedy decode runs
    and gives the same tokens with the prompt batched as one by one."""
    llm = LLM(str(written(scheme)), dtype="bfloat16")
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(len(t) == GREEDY.max_tokens for t in batched)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quant_method is not None


def _edit(path, tmp_path, change) -> str:
    dst = tmp_path / "edited"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _group(q):
    return q["config_groups"]["group_0"]


REFUSALS = {
    "static activation scales": lambda q: _group(q)["input_activations"].update(dynamic=False, strategy="tensor"),
    "asymmetric activations": lambda q: _group(q)["input_activations"].update(symmetric=False),
    "kv_cache_scheme": lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
    "sparsity": lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
    "transforms": lambda q: q.update(transform_config={"config_groups": {"u": {}}}),
    "no layer of this model matches": lambda q: _group(q).update(targets=["Embedding"]),
    "quantized output head": lambda q: q.update(ignore=[]),
    "int8 weights in format marlin-24": lambda q: _group(q).update(format="marlin-24"),
    "int8 weights group": lambda q: _group(q)["weights"].update(strategy="group", group_size=32),
    "int2 weights": lambda q: _group(q)["weights"].update(num_bits=2),
    "output_activations": lambda q: _group(q).update(output_activations=dict(_group(q)["input_activations"])),
    "quantization_status 'frozen'": lambda q: q.update(quantization_status="frozen"),
    "field(s) surprise": lambda q: q.update(surprise=1),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_what_we_do_not_build_is_refused_by_name(written, tmp_path, what):
    path = _edit(written("w8a8"), tmp_path, REFUSALS[what])
    with pytest.raises(UnsupportedLever, match=what.replace("(", r"\(").replace(")", r"\)")):
        load_model(path, "float32")


def test_refusals_of_the_other_schemes(written, tmp_path):
    def asym_block(q):
        _group(q)["weights"].update(symmetric=False)

    with pytest.raises(UnsupportedLever, match="asymmetric fp8 weights"):
        load_model(_edit(written("fp8-block"), tmp_path, asym_block), "float32")
    shutil.rmtree(tmp_path / "edited")
    with pytest.raises(ValueError, match="actorder='group' has been removed"):  # the package's own refusal
        load_model(_edit(written("w4a16"), tmp_path, lambda q: _group(q)["weights"].update(actorder="group")),
                   "float32")
    shutil.rmtree(tmp_path / "edited")
    with pytest.raises(UnsupportedLever, match="activations with int4 weights"):
        load_model(_edit(written("w4a16"), tmp_path, lambda q: _group(q).update(
            input_activations={"num_bits": 4, "type": "int", "strategy": "token", "dynamic": True})), "float32")


def test_quantization_flag_must_name_what_the_checkpoint_holds(written):
    path = written("w8a8")
    with pytest.raises(UnsupportedLever, match="compressed-tensors int8"):
        load_model(path, "float32", quantization="int4")
    for flag in ("int8", "compressed-tensors"):
        assert load_model(path, "float32", quantization=flag).quant_method.name == "compressed-tensors"
    with pytest.raises(UnsupportedLever, match="leaves the output head out"):
        load_model(path, "float32", lm_head="same")
    assert load_model(path, "float32", lm_head="int8").lm_head.quant_method.name == "int8"


def test_our_w8a8_export_loads_back_as_our_int8(source, tmp_path):
    """`leverlab quantize --method w8a8` writes our int8 in this format: read back, the layers hold int8.py's own
    values and scales, and in bf16 (where activations are quantized by the same kernels) the greedy tokens are
    those of --quantization int8. The source holds bf16 numbers, as real checkpoints do: --quantization int8 at
    bf16 quantizes the bf16 weight, the export the checkpoint's own (float32 here), the same values then."""
    from leverlab.cli import main

    dst = tmp_path / "w8a8"
    assert main(["quantize", str(source), str(dst), "--method", "w8a8"]) == 0
    src = str(source)
    ours = LLM(src, dtype="bfloat16", quantization="int8", lm_head_quantization="none")
    read = LLM(str(dst), dtype="bfloat16")
    a, b = ours.engine.runner.model, read.engine.runner.model
    for (name, la), (_, lb) in zip(a.named_modules(), b.named_modules()):
        if isinstance(la, Linear) and la.quant_method is not None:
            assert torch.equal(la.quant_method.dequantize(la), lb.quant_method.dequantize(lb)), name
    assert b.lm_head.quant_method is None
    tokens = [o.outputs[0].token_ids for o in ours.generate(PROMPTS, GREEDY)]
    assert tokens == [o.outputs[0].token_ids for o in read.generate(PROMPTS, GREEDY)]
    # A prefill's logits (the int8 GEMM path): bit for bit.
    a = load_model(src, "bfloat16", quantization="int8", lm_head="none")
    assert torch.equal(_logits(a), _logits(load_model(dst, "bfloat16")))


def _logits(model, ids=tuple(range(10, 40))):
    from leverlab.layers.attention import AttentionMetadata, forward_context

    cfg, ids = model.config, torch.tensor(ids)
    t = len(ids)
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), torch.tensor([[0, 1]]), torch.tensor([t]), torch.tensor([0, t]))
    with torch.no_grad(), forward_context(meta, caches):
        return model.compute_logits(model(ids, torch.arange(t)))


@pytest.mark.parametrize("value,ok", [(0, True), (1, False)])
def test_zero_points_of_a_symmetric_scheme_are_read_and_must_be_zero(written, tmp_path, value, ok):
    """Older compressed-tensors versions store zero points of symmetric int8 layers too (all zero)."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "with-zp"
    shutil.copytree(written("w8a8"), dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name.replace("weight_scale", "weight_zero_point")] = torch.full_like(tensors[name], value,
                                                                                         dtype=torch.int8)
        save_file(tensors, str(file), metadata={"format": "pt"})
    if ok:
        ref = load_model(written("w8a8"), "float32").model.layers[1].mlp.down_proj
        got = load_model(dst, "float32").model.layers[1].mlp.down_proj
        assert torch.equal(got.quant_method.dequantize(got), ref.quant_method.dequantize(ref))
    else:
        with pytest.raises(ValueError, match="non-zero weight_zero_point"):
            load_model(dst, "float32")


def _as_hf_fp8(ct_folder, dst, qcfg: dict) -> str:
    """The compressed-tensors FP8-block checkpoint rewritten in Hugging Face's own fp8 format (Qwen3-*-FP8's):
    the same e4m3 weights and block scales, the scales named weight_scale_inv."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ct_folder, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        tensors = {k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in tensors.items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_hugging_face_fp8_block_checkpoints_read_the_same_weights(written, tmp_path):
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    path = _as_hf_fp8(written("fp8-block"), tmp_path / "hf", qcfg)
    model = load_model(path, "float32")
    assert model.quant_method.name == "fp8" and model.lm_head.quant_method is None
    for name, layer in model.named_modules():
        if isinstance(layer, Linear) and name != "lm_head":
            w = torch.cat([ct.reference(written("fp8-block"), part) for part, _ in
                           sorted(parts_of(name), key=lambda p: layer.shards[p[1]][0] if p[1] else 0)])
            assert torch.equal(layer.quant_method.dequantize(layer), w), name
    assert LLM(path, dtype="bfloat16").generate(PROMPTS, GREEDY)[0].outputs[0].token_ids
    for key, value, what in (("activation_scheme", "static", "static activation scales"),
                             ("fmt", "e5m2", "e4m3 only"), ("surprise", 1, "surprise")):
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        cfg["quantization_config"] = {**qcfg, key: value}
        (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UnsupportedLever, match=what):
            load_model(path, "float32")
