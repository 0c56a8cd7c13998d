"""vLLM's Python habits on LLM: generate(prompts, sampling_params=...), LLM.chat, vLLM's constructor keywords
(mapped, or refused by name), and logprobs as Logprob objects with rank, decoded_token and
cumulative_logprob."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from leverlab import LLM, SamplingParams
from leverlab.errors import UnsupportedLever
from leverlab.outputs import Logprob

KW = dict(dtype="float32", enforce_eager=True, num_kv_blocks=32)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["def add(a, b):", "The quick brown"]


@pytest.fixture(scope="module")
def path(checkpoint_factory) -> str:
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, **KW) as llm:
        yield llm


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_generate_takes_sampling_params_by_vllms_name(llm):
    base = _tokens(llm.generate(PROMPTS, GREEDY))
    assert _tokens(llm.generate(PROMPTS, sampling_params=GREEDY)) == base
    assert _tokens(llm.generate(PROMPTS, params=GREEDY)) == base  # our older name still works
    assert _tokens(llm.generate(PROMPTS, sampling_params=[GREEDY, GREEDY], use_tqdm=False)) == base
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=None)) == base  # None is vLLM's default: no LoRA
    with pytest.raises(ValueError, match="not both"):
        llm.generate(PROMPTS, sampling_params=GREEDY, params=GREEDY)
    with pytest.raises(UnsupportedLever, match="lora_request"):
        llm.generate(PROMPTS, GREEDY, lora_request=object())
    with pytest.raises(UnsupportedLever, match="priority"):
        llm.generate(PROMPTS, GREEDY, priority=[1, 2])
    with pytest.raises(UnsupportedLever, match="prompt_adapter_request"):
        llm.generate(PROMPTS, GREEDY, prompt_adapter_request=None)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": None}}, GREEDY)


def test_vllm_constructor_keywords_map_onto_the_engine(path):
    with LLM(path, dtype="auto", gpu_memory_utilization=0.01, enforce_eager=True, max_num_seqs=3, seed=7,
             max_model_len=256, tensor_parallel_size=1, trust_remote_code=True, revision=None,
             tokenizer=path) as llm:
        cfg = llm.engine.config
        assert (cfg.kv_cache_memory_fraction, cfg.execution_mode, cfg.max_num_seqs, cfg.seed) == (0.01, "eager", 3, 7)
        assert cfg.dtype == "bfloat16" and llm.engine.max_model_len == 256
        assert llm.get_tokenizer() is llm.tokenizer
    for bad, name in (({"swap_space": 4}, "swap_space"), ({"disable_custom_all_reduce": False}, "disable_custom_all_reduce"),
                      ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")):
        with pytest.raises(UnsupportedLever, match=name):
            LLM(path, **bad)


def test_trust_remote_code_is_refused_with_a_reason_for_an_architecture_not_ours(path, tmp_path):
    other = shutil.copytree(path, tmp_path / "custom")
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["MyCustomForCausalLM"]
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.MyCustomForCausalLM"}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="never model code from the checkpoint's repository"):
        LLM(str(other), trust_remote_code=True, **KW)
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(other), **KW)


def test_chat_renders_with_the_template_as_the_server_does(llm):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    text = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    want = llm.generate(text, GREEDY)[0]
    one = llm.chat(conv, GREEDY)
    assert len(one) == 1 and one[0].outputs[0].token_ids == want.outputs[0].token_ids and one[0].prompt == text
    # content as text parts, as the OpenAI message format allows
    parts = [conv[0], {"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    assert llm.chat(parts, sampling_params=GREEDY)[0].prompt == text
    two = llm.chat([conv, [{"role": "user", "content": "hi"}]], GREEDY, use_tqdm=False)
    assert [o.prompt for o in two] == [text, llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)]
    # continuing the final (assistant) message instead of opening a new one
    cont = llm.chat(conv + [{"role": "assistant", "content": "return"}], GREEDY, add_generation_prompt=False,
                    continue_final_message=True)[0]
    assert cont.prompt.endswith("<|im_start|>assistant\nreturn")
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert llm.chat(conv, GREEDY, chat_template=own)[0].prompt == "[system] be brief\n[user] def add(a, b):\n"
    with pytest.raises(UnsupportedLever, match="lora_request"):
        llm.chat(conv, GREEDY, lora_request="adapter")
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(ValueError, match="tokenize"):
        llm.chat(conv, GREEDY, chat_template_kwargs={"tokenize": True})


def test_chat_template_kwargs_reach_the_template(checkpoint_factory):
    with LLM(checkpoint_factory("qwen3", think_tags=True), **KW) as llm:
        conv = [{"role": "user", "content": "hi"}]
        assert "<think>" not in llm.chat(conv, GREEDY)[0].prompt
        off = llm.chat(conv, GREEDY, chat_template_kwargs={"enable_thinking": False})[0].prompt
        assert off.endswith("<think>\n\n</think>\n\n")


def test_logprobs_are_vllm_logprob_objects(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[0], sp)[0]
    o = out.outputs[0]
    assert len(o.logprobs) == len(o.token_ids) == 6
    total = 0.0
    for pos, tok in zip(o.logprobs, o.token_ids):
        assert next(iter(pos)) == tok and 3 <= len(pos) <= 4  # the chosen token first, then the top 3
        assert all(isinstance(v, Logprob) for v in pos.values())
        chosen = pos[tok]
        assert chosen.rank == 1 and chosen.decoded_token == llm.tokenizer.decode([tok])  # greedy: the top one
        ranked = sorted(pos.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked] == list(range(1, len(pos) + 1))
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        total += chosen.logprob
    assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-6, abs_tol=1e-6)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for pos, tok in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert tok in pos and pos[tok].rank >= 1 and all(isinstance(v, Logprob) for v in pos.values())
        assert pos[tok].decoded_token == llm.tokenizer.decode([tok])
    # a sampled token's rank is its place in the whole vocabulary, not 1 as greedy's always is
    hot = SamplingParams(temperature=5.0, seed=1, max_tokens=16, ignore_eos=True, logprobs=0)
    ranks = [next(iter(p.values())).rank for p in llm.generate(PROMPTS[1], hot)[0].outputs[0].logprobs]
    assert all(r >= 1 for r in ranks) and max(ranks) > 1
    plain = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None  # as vLLM, without logprobs asked


def test_stream_gives_logprob_objects_too(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    last = list(llm.stream(PROMPTS[0], sp))[-1].outputs[0]
    assert all(isinstance(v, Logprob) for pos in last.logprobs for v in pos.values())
    assert last.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(last.logprobs, last.token_ids)))


def test_engine_outputs_keep_plain_floats(path):
    """The engine's own outputs (what the server writes as JSON) keep floats: LLM converts a copy."""
    from leverlab.config import EngineConfig
    from leverlab.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=16))
    engine.add_request("r", "def add", SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    o = outs[-1].outputs[0]
    assert all(isinstance(v, float) for pos in o.logprobs for v in pos.values()) and len(o.ranks) == 3
