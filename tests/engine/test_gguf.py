"""GGUF files as models: llama.cpp's converter writes them from the tests' tiny checkpoints (tests/gguf_files.py).

F32 is lossless, so a converted file must load into exactly the HF folder's weights and give its greedy tokens in
float32 (llama's Q/K rows, which the converter permutes, included). Q8_0: our int8 keeps one scale per row, so
the file is requantized per row; what holds exactly is that it serves as our int8 of its own dequantized weights.
Q4_0 is our int4 at groups of 32 bit for bit: every layer's weight equals the gguf package's dequantization.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from leverlab import LLM, SamplingParams
from leverlab.errors import UnsupportedLever
from leverlab.models import gguf_file, gguf_loader
from leverlab.models.config import ModelConfig
from leverlab.models.loader import load_model
from leverlab.models.tokenizer import load_tokenizer
from leverlab.quant.gguf import GGUFQ4Method
from leverlab.quant.int4 import Int4Method
from leverlab.quant.int8 import Int8Method
from tests.checkpoints import CHAT_TEMPLATE
from tests.gguf_files import convert, write_q4_0

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf(checkpoint_factory, tmp_path_factory):
    """gguf(arch, outtype) -> (HF folder, GGUF path), converted once per module."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(arch: str, outtype: str) -> tuple[Path, Path]:
        if (arch, outtype) not in made:
            hf = Path(checkpoint_factory(arch))
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{outtype}.gguf"
            made[arch, outtype] = (hf, convert(hf, out, outtype))
        return made[arch, outtype]

    return get


def _tokens(model, **kw) -> list[list[int]]:
    llm = LLM(model, dtype="float32", **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_f32_gguf_is_the_hf_folder(gguf, arch):
    hf, path = gguf(arch, "f32")
    a, b = ModelConfig.from_folder(hf), ModelConfig.from_folder(path)
    assert dataclasses.replace(b, torch_dtype=a.torch_dtype) == a  # rope_scaling (llama3 from rope_freqs) included
    ours, theirs = load_model(hf, "float32"), load_model(path, "float32")
    sa, sb = ours.state_dict(), theirs.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name  # llama's Q/K rows unpermuted exactly


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_f32_gguf_greedy_tokens_match_hf(gguf, arch):
    hf, path = gguf(arch, "f32")
    tok_hf, tok_gguf = load_tokenizer(hf), load_tokenizer(path)  # the GGUF's own, built from its metadata
    for p in PROMPTS:
        assert tok_gguf.encode(p) == tok_hf.encode(p)
    assert tok_gguf.chat_template == CHAT_TEMPLATE
    assert _tokens(path) == _tokens(hf)


def test_q8_0_gguf_serves_as_our_int8_of_its_weights(gguf, tmp_path, caplog):
    hf, path = gguf("qwen3", "q8_0")
    cfg = ModelConfig.from_folder(path)
    # The reference: the HF folder with the file's weights, dequantized by the gguf package (exact in float32).
    ref = tmp_path / "dequantized"
    ref.mkdir()
    for f in hf.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (ref / f.name).write_bytes(f.read_bytes())
    save_file({n: t.float().contiguous() for n, t in gguf_loader.tensors(path, cfg, None)},
              str(ref / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="leverlab"):
        model = load_model(path, "float32")
    assert "requantized per output row" in caplog.text
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, Int8Method)
    base = load_model(ref, "float32", quantization="int8")
    for (name, a), (_, b) in zip(model.named_modules(), base.named_modules(), strict=True):
        if getattr(a, "qweight", None) is not None:
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales), name
    assert _tokens(path) == _tokens(ref, quantization="int8")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_0_gguf_is_int4_bit_for_bit(gguf, tmp_path, arch, dtype):
    from gguf.quants import dequantize

    _, f32 = gguf(arch, "f32")
    path = write_q4_0(f32, tmp_path / "q4_0.gguf")
    cfg = ModelConfig.from_folder(path)
    model = load_model(path, dtype)
    r = gguf_file.reader(path)
    by_name = {t.name: t for t in r.tensors}

    def ref(name: str) -> torch.Tensor:
        t = by_name[name]
        assert t.tensor_type.name == "Q4_0"
        w = torch.from_numpy(np.ascontiguousarray(dequantize(np.asarray(t.data), t.tensor_type)))
        part = name.split(".")[2]
        if arch == "llama" and part in ("attn_q", "attn_k"):
            w = w[gguf_loader._unpermute_rows(cfg, part)]
        return w

    for i, layer in enumerate(model.model.layers):
        for module, parts in ((layer.self_attn.qkv_proj, ("attn_q", "attn_k", "attn_v")),
                              (layer.self_attn.o_proj, ("attn_output",)),
                              (layer.mlp.gate_up_proj, ("ffn_gate", "ffn_up")),
                              (layer.mlp.down_proj, ("ffn_down",))):
            assert isinstance(module.quant_method, GGUFQ4Method) and module.quant_method.group_size == 32
            want = torch.cat([ref(f"blk.{i}.{p}.weight") for p in parts])
            assert torch.equal(module.quant_method.dequantize(module), want), (i, parts)
    llm = LLM(path, dtype=dtype)
    try:
        out = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0]
        assert len(out.token_ids) == GREEDY.max_tokens
    finally:
        llm.engine.close()


def test_quantization_flag_on_a_gguf(gguf, tmp_path, caplog):
    _, f32 = gguf("qwen3", "f32")
    q4 = write_q4_0(f32, tmp_path / "q4_0.gguf")
    assert gguf_loader.quant_method(f32, None) is None  # float: the model dtype, as a safetensors folder
    assert type(gguf_loader.quant_method(f32, "int4")) is Int4Method  # quantized at load, as for a folder
    assert isinstance(gguf_loader.quant_method(q4, "int4-g64"), GGUFQ4Method)  # the file's groups of 32 win
    with caplog.at_level(logging.WARNING, logger="leverlab"):
        m = gguf_loader.quant_method(q4, "int8")  # another family: dequantized, then requantized
    assert type(m) is Int8Method and not m.checkpoint and "Q4_0" in caplog.text
    with pytest.raises(UnsupportedLever, match="awq"):
        gguf_loader.quant_method(q4, "awq")


def test_tokenizer_folder_flag(gguf):
    hf, path = gguf("qwen3", "f32")
    llm = LLM(path, dtype="float32", tokenizer=str(hf))
    try:
        assert llm.tokenizer.name_or_path == str(hf)
    finally:
        llm.engine.close()


def test_bad_gguf_files(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(FileNotFoundError, match="nor a GGUF file"):
        ModelConfig.from_folder(fake)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 7)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_folder(cut)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_gguf_shards_over_tensor_parallel_ranks(gguf, tmp_path, kind):
    """Each rank cuts its slice of the unpacked tensors (llama's Q/K rows unpermuted first): two ranks give one
    rank's greedy tokens."""
    if kind == "q8_0":
        path = gguf("llama", "q8_0")[1]
    else:
        path = write_q4_0(gguf("llama", "f32")[1], tmp_path / "q4_0.gguf")
    assert _tokens(path, tensor_parallel_size=2) == _tokens(path)
