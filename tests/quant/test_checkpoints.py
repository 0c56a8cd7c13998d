"""Pre-quantized checkpoints: AWQ and GPTQ layouts written here load back to the weights they encode, and
`leverlab quantize` output loads to exactly what quantizing at load time gives."""

import json

import pytest
import torch

from leverlab.errors import UnsupportedLever
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.layers.linear import Linear
from leverlab.models.decoder import CausalLM
from leverlab.models.loader import load_model
from tests.quant.formats import write_float, write_quantized


def packed_reference(model, ref: dict[str, torch.Tensor], module_name: str) -> torch.Tensor:
    """The float [out, in] weight of one of our (packed) modules, assembled from checkpoint names."""
    parent, _, leaf = module_name.rpartition(".")
    parts = [(f"{parent}.{ck}.weight", shard) for ck, (ours, shard) in CausalLM.PACKED.items() if ours == leaf]
    if not parts:
        return ref[f"{module_name}.weight"]
    layer = dict(model.named_modules())[module_name]
    return torch.cat([ref[name] for name, shard in sorted(parts, key=lambda p: layer.shards[p[1]][0])])


def logits(model, ids=tuple(range(10, 40))):
    cfg = model.config
    ids = torch.tensor(ids)
    t = len(ids)
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), torch.tensor([[0, 1]]), torch.tensor([t]), torch.tensor([0, t]))
    with torch.no_grad(), forward_context(meta, caches):
        return model.compute_logits(model(ids, torch.arange(t)))


@pytest.mark.parametrize("fmt,act_order,arch", [("awq", False, "qwen3"), ("gptq", False, "qwen2"),
                                                ("gptq", True, "qwen3")])
def test_prequantized_checkpoint_reads_back_its_weights(checkpoint_factory, tmp_path, fmt, act_order, arch):
    src = checkpoint_factory(arch)
    ref = write_quantized(src, tmp_path / fmt, fmt, group_size=32, act_order=act_order)
    model = load_model(tmp_path / fmt, "float32")
    assert model.quant_method.name == fmt and model.quant_method.group_size == 32
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            got = module.quant_method.dequantize(module)
            assert torch.equal(got, packed_reference(model, ref, name)), name
            n += 1
    assert n == 4 * model.config.num_layers  # qkv, o, gate_up, down
    assert model.lm_head.quant_method is None  # the head stays in the model dtype
    # The whole model: the same logits as a float model holding the encoded weights.
    fake = load_model(write_float(src, tmp_path / "fake", ref), "float32")
    assert torch.allclose(logits(model), logits(fake), atol=1e-4, rtol=0)


def test_quantize_flag_must_match_the_checkpoint(checkpoint_factory, tmp_path):
    write_quantized(checkpoint_factory("qwen3"), tmp_path / "awq", "awq", group_size=32)
    with pytest.raises(UnsupportedLever, match="pre-quantized with awq"):
        load_model(tmp_path / "awq", "float32", quantization="int8")
    load_model(tmp_path / "awq", "float32", quantization="int4")  # the same math: accepted


@pytest.mark.parametrize("method,load_time", [("int8", "int8"), ("int4", "int4"), ("awq", "int4-g128")])
def test_quantize_cli_output_loads_without_requantizing(checkpoint_factory, tmp_path, method, load_time):
    from leverlab.cli import main

    src = checkpoint_factory("llama")  # untied head, sharded checkpoint with an index
    gs = ["--group-size", "64"] if method == "awq" else []
    dst = tmp_path / method
    assert main(["quantize", src, str(dst), "--method", method, *gs]) == 0
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == ("int8" if method == "int8" else "awq")
    if method == "awq":  # --group-size 64 with awq: compare against int4 at group 64
        load_time = "int4-g64"
    pre = load_model(dst, "float32")
    at_load = load_model(src, "float32", quantization=load_time)
    for (name, a), (_, b) in zip(pre.named_modules(), at_load.named_modules()):
        if isinstance(a, Linear) and a.quant_method is not None:
            # fp16 scales in the AWQ layout round once; int8 keeps the checkpoint dtype (fp32 here): exact
            atol = 0 if method == "int8" else 2e-3 * b.quant_method.dequantize(b).abs().max().item()
            assert torch.allclose(a.quant_method.dequantize(a), b.quant_method.dequantize(b), atol=atol, rtol=0), name
    # The head is written in float; at load, int8/int4 put it in int8 (--lm-head-quantization auto: compared in the
    # loop above), AWQ checkpoints keep theirs as vLLM does.
    if qcfg["quant_method"] == "awq":
        assert pre.lm_head.quant_method is None
        assert torch.equal(pre.lm_head.weight, load_model(src, "float32").lm_head.weight)
    else:
        assert pre.lm_head.quant_method.name == at_load.lm_head.quant_method.name == "int8"
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    assert size < sum(f.stat().st_size for f in __import__("pathlib").Path(src).glob("*.safetensors"))


def test_server_summary_names_the_checkpoints_own_quantization(checkpoint_factory, tmp_path):
    """A pre-quantized checkpoint served without --quantization: the startup line says what the weights are."""
    import asyncio

    from leverlab.config import EngineConfig
    from leverlab.engine.async_engine import AsyncLLM
    from leverlab.server.cli import lever_summary

    write_quantized(checkpoint_factory("qwen3"), tmp_path / "awq", "awq", group_size=32)

    async def summary() -> str:
        engine = AsyncLLM(EngineConfig(model=str(tmp_path / "awq"), dtype="float32", num_kv_blocks=8))
        try:
            return lever_summary(engine)
        finally:
            await engine.shutdown(1.0)

    line = asyncio.run(summary())
    assert "quantization=awq" in line, line
