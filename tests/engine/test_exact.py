"""Our model code against transformers on tiny random checkpoints, float32: logits and greedy tokens."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.models.loader import load_model
from tests.checkpoints import ARCHS
from tests.engine.helpers import hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [100, 3, 250, 17, 9, 31, 2, 8]]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    ours, ref = load_model(path, "float32"), hf_model(path)
    cfg = ours.config
    ids = torch.tensor(PROMPTS[1])
    t = len(ids)
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), torch.tensor([[0, 1, 2]]), torch.tensor([t]), torch.tensor([0, t]))
    with torch.no_grad():
        with forward_context(meta, caches):
            logits = ours.compute_logits(ours(ids, torch.arange(t)))
        expected = ref(ids[None]).logits[0]
    assert torch.allclose(logits, expected, atol=1e-4, rtol=0), (logits - expected).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    llm = LLM(path, dtype="float32")
    ref = hf_model(path)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(ref, prompt, 40)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_bfloat16_close_to_transformers(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path, dtype="bfloat16")
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0))[0]
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([PROMPTS[1]])).logits[0].float(), -1)
    ours = [lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], PROMPTS[1][1:])]
    theirs = [expected[i, tok].item() for i, tok in enumerate(PROMPTS[1][1:])]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.1
