"""The compiled fast path (the default outside tests) gives the same tokens as eager."""

import pytest

from leverlab import LLM, SamplingParams


@pytest.mark.slow
def test_compiled_equals_eager(checkpoint_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("LEVERLAB_CACHE", str(tmp_path))  # a cold compile cache, like a fresh machine
    path = checkpoint_factory("qwen3")
    prompts = [[1, 2, 3], list(range(10, 45)), [7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = LLM(path, dtype="float32", execution_mode="eager").generate(prompts, params)
    compiled = LLM(path, dtype="float32", execution_mode="compiled").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
