"""Weight sharding at load time, without processes: a model loaded as rank r of 2 holds exactly its slice of
what TP=1 holds, for float weights, quantize-at-load methods and pre-quantized AWQ / GPTQ checkpoints.
(Loading needs no communication; the forward does, and test_tensor_parallel.py runs it.)"""

from __future__ import annotations

import pytest
import torch

from leverlab.distributed.parallel_state import TPState
from leverlab.errors import UnsupportedLever
from leverlab.layers.linear import Linear
from leverlab.models.config import ModelConfig
from leverlab.models.loader import load_model
from tests.quant.formats import write_quantized

TP = 2


def ranks(path, **kw):
    return [load_model(path, "float32", tp=TPState(rank=r, size=TP), **kw) for r in range(TP)]


def weight(module) -> torch.Tensor:
    return module.quant_method.dequantize(module) if module.quant_method is not None else module.weight.float()


def expected_slice(full: torch.Tensor, name: str, cfg, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a TP=1 [out, in] weight (qwen3 tiny: 4 query heads, 2 KV heads)."""
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if name.endswith("qkv_proj"):
        q, k, v = full.split([nh * hd, nkv * hd, nkv * hd])
        return torch.cat([part.chunk(TP)[rank] for part in (q, k, v)])
    if name.endswith("gate_up_proj"):
        return torch.cat([part.chunk(TP)[rank] for part in full.chunk(2)])
    if name.endswith(("o_proj", "down_proj")):
        return full.chunk(TP, dim=1)[rank]
    if name == "lm_head":
        return full.chunk(TP)[rank]
    raise AssertionError(name)


def check_shards(path, **kw) -> int:
    full = load_model(path, "float32", **kw)
    fulls = {n: m for n, m in full.named_modules() if isinstance(m, Linear)}
    n = 0
    for rank, model in enumerate(ranks(path, **kw)):
        emb = full.model.embed_tokens.weight.chunk(TP)[rank]
        assert torch.equal(model.model.embed_tokens.weight, emb)
        for name, module in model.named_modules():
            if not isinstance(module, Linear):
                continue
            want = expected_slice(weight(fulls[name]), name, full.config, rank)
            assert torch.equal(weight(module), want), name
            n += 1
    return n


def test_float_weights_split_by_heads_mlp_and_vocab(checkpoint_factory):
    assert check_shards(checkpoint_factory("qwen3")) == TP * (4 * 2 + 1)  # 4 per layer + the head


@pytest.mark.parametrize("arch,kw", [("qwen3-moe", {}), ("qwen2-moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}),
                                     ("mixtral", {}), ("qwen2-moe", {"quantization": "int8"})])
def test_moe_experts_split_by_width_router_replicated(checkpoint_factory, arch, kw):
    """Every expert (and Qwen2-MoE's shared expert) is an MLP split as a dense one (gate/up by columns, down by
    rows); the router and the shared expert's sigmoid gate are whole on every rank."""
    quant = {k: v for k, v in kw.items() if k == "quantization"}
    path = checkpoint_factory(arch, **{k: v for k, v in kw.items() if k != "quantization"})
    check_shards(path, **quant)
    full = dict(load_model(path, "float32", **quant).named_parameters())
    whole = [n for n in full if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))]
    assert len(whole) == sum(ModelConfig.from_folder(path).sparse_layers) * (2 if arch == "qwen2-moe" else 1)
    for model in ranks(path, **quant):
        params = dict(model.named_parameters())
        assert all(torch.equal(params[n], full[n]) for n in whole)


def test_stacked_expert_tensors_split_like_per_expert_ones(checkpoint_factory, tmp_path):
    """Experts stored as transformers holds them ([E, 2I, H] and [E, H, I]): each expert's view is cut as its own
    tensor would be, int8's whole-row scales included."""
    from pathlib import Path

    from tests.engine.test_moe import _stack_experts

    stacked = _stack_experts(Path(checkpoint_factory("qwen3-moe")), tmp_path / "stacked")
    check_shards(stacked, quantization="int8")


@pytest.mark.parametrize("method", ["int4", "int4-g32"])
def test_int4_quantizes_each_slice_like_tp1(checkpoint_factory, method):
    # groups of 32 or 64 inputs never straddle the halves: identical weights
    check_shards(checkpoint_factory("qwen3"), quantization=method)


def test_int8_row_parallel_scales_from_whole_rows(checkpoint_factory):
    # a row-parallel rank's scales come from the whole rows (recorded before the cut): TP=1's int8 weights exactly
    check_shards(checkpoint_factory("qwen3"), quantization="int8")


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_prequantized_packed_tensors_split(checkpoint_factory, tmp_path, fmt):
    write_quantized(checkpoint_factory("qwen3"), tmp_path / fmt, fmt, group_size=32)
    check_shards(tmp_path / fmt)


def test_refuses_splits_off_group_boundaries(checkpoint_factory, tmp_path):
    # llama tiny: o_proj reads 4 heads x 16 = 64 inputs, one group of 64; a rank's 32 are not a whole group
    write_quantized(checkpoint_factory("llama"), tmp_path / "awq", "awq", group_size=64)
    with pytest.raises(UnsupportedLever, match="tensor-parallel-size 2 .*group size 64"):
        ranks(tmp_path / "awq")


def test_refuses_gptq_act_order_row_split(checkpoint_factory, tmp_path):
    write_quantized(checkpoint_factory("qwen3"), tmp_path / "gptq", "gptq", group_size=32, act_order=True)
    with pytest.raises(UnsupportedLever, match="desc_act"):
        ranks(tmp_path / "gptq")


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16", "w4a16", "w4a16-asym", "fp8-channel"])
def test_compressed_tensors_checkpoints_split(checkpoint_factory, tmp_path, scheme):
    """Written by the compressed-tensors package (tests/quant/ct_writer.py); groups of 32 inputs, int4 zero points
    packed 8 output rows to an int32 (a rank's k/v slice holds whole words)."""
    from tests.quant import ct_writer

    spec = dict(ct_writer.SCHEMES[scheme])
    if scheme.startswith("w4a16"):
        spec = {"weights": {**spec["weights"], "group_size": 32}}
    path = ct_writer.write_ct(checkpoint_factory("qwen3"), tmp_path / scheme, spec, ct_writer.FORMATS[scheme])
    check_shards(path)


def test_compressed_tensors_block_fp8_is_refused_split(checkpoint_factory, tmp_path):
    from tests.quant import ct_writer

    spec = {**ct_writer.SCHEMES["fp8-block"]}
    spec["weights"] = {**spec["weights"], "block_structure": [32, 32]}
    spec["input_activations"] = {**spec["input_activations"], "group_size": 32}
    path = ct_writer.write_ct(checkpoint_factory("qwen3"), tmp_path / "b", spec, "float-quantized")
    with pytest.raises(UnsupportedLever, match="no known way to split checkpoint tensor 'weight_scale"):
        ranks(path)
