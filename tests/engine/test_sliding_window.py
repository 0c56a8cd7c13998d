"""Sliding-window attention (Mistral; Qwen2 with use_sliding_window): exact against transformers, and
blocks that fall wholly outside the window are handed back."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from tests.engine.helpers import hf_greedy

PROMPTS = [list(range(10, 40)), [3, 4, 5], list(range(50, 63))]


@pytest.mark.parametrize("arch", ["mistral", "qwen2-window"])
def test_greedy_matches_transformers(checkpoint_factory, arch):
    from transformers import AutoModelForCausalLM

    path = checkpoint_factory(arch)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=8)  # chunks cross the window too
    assert llm.engine.model_config.layer_windows == ((8, 8) if arch == "mistral" else (None, 8))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(ref, prompt, 24)
        assert out.outputs[0].token_ids == expected
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_blocks_behind_the_window_are_released(checkpoint_factory):
    # 6 blocks of 4 tokens hold 24 positions; a window of 8 needs at most 3-4 blocks live, so a 60-token
    # sequence completes without a single preemption.
    llm = LLM(checkpoint_factory("mistral"), dtype="float32", block_size=4, num_kv_blocks=6, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=57, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 57 and out.metrics.num_preemptions == 0
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free == 6
