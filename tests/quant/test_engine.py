"""A quantized model through the whole engine (LLM API) and the HTTP server."""

import httpx
import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.layers.linear import Linear
from tests.quant.formats import write_float

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7]]


def fake_quant_weights(llm) -> dict[str, torch.Tensor]:
    """Checkpoint-named float weights equal to what the engine's quantized layers multiply by."""
    from leverlab.models.decoder import CausalLM

    model, out = llm.engine.runner.model, {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.quant_method is not None:
            w = m.quant_method.dequantize(m)
            parent, _, leaf = name.rpartition(".")
            parts = [(ck, shard) for ck, (ours, shard) in CausalLM.PACKED.items() if ours == leaf]
            for ck, shard in parts or [(leaf, None)]:
                off, size = m.shards[shard] if shard else (0, w.shape[0])
                out[f"{parent}.{ck}.weight".lstrip(".")] = w[off:off + size]
    return out


@pytest.mark.parametrize("method,arch", [("int8", "qwen3"), ("int4-g32", "qwen3"), ("fp8", "qwen3"),
                                         ("int8+head", "llama"), ("int4+head", "qwen2")])
def test_quantized_engine_generates_like_its_dequantized_model(checkpoint_factory, tmp_path, method, arch):
    """Greedy tokens through scheduler, paged cache and sampler equal those of a float model holding the
    dequantized weights: the quantized path changes the weights and nothing else."""
    path = checkpoint_factory(arch)
    llm = LLM(path, dtype="float32", quantization=method)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    ref = LLM(str(write_float(path, tmp_path / "fake", fake_quant_weights(llm))), dtype="float32")
    assert got == [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_quantized_checkpoint_served_over_http(checkpoint_factory, tmp_path):
    from leverlab.models.quantize import quantize_folder
    from tests.server.conftest import ServerProcess

    dst = quantize_folder(checkpoint_factory("qwen3"), tmp_path / "q4", "int4")
    server = ServerProcess(dst, "--kv-cache-dtype", "int8", log_path=tmp_path / "server.log")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "def f(x):", "max_tokens": 12, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
    finally:
        server.stop()


def test_tied_head_quantized_keeps_the_embedding_in_the_model_dtype(checkpoint_factory):
    llm = LLM(checkpoint_factory("qwen3"), dtype="bfloat16", quantization="int4+head")
    model = llm.engine.runner.model
    assert model.lm_head.quant_method is not None and model.lm_head.weight.numel() == 0
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and model.model.embed_tokens.weight.numel() > 0
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_bad_quantization_flag_is_refused_with_the_choices(checkpoint_factory):
    from leverlab.errors import UnsupportedLever

    with pytest.raises(UnsupportedLever, match="int8"):
        LLM(checkpoint_factory("qwen3"), quantization="q4_0")
