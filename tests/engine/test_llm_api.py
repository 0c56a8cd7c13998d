"""The Python API in vLLM's shapes: prompt forms (str, token ids, {"prompt"}, {"prompt_token_ids"}), and an
LLM's lifetime (close(), the context manager, workers freed on collection, a second tensor-parallel LLM)."""

from __future__ import annotations

import gc
import os

import pytest

from leverlab import LLM, SamplingParams
from leverlab.errors import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def path(checkpoint_factory) -> str:
    return str(checkpoint_factory("qwen3"))


def test_vllm_prompt_forms_give_the_same_tokens(path):
    with LLM(path, dtype="float32", execution_mode="eager") as llm:
        text = "def add(a, b):"
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        base = _tokens(llm.generate([ids, [5, 6, 7]], GREEDY))
        assert _tokens(llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": [5, 6, 7]}], GREEDY)) == base
        assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == base[:1]  # a single TokensPrompt
        by_text = _tokens(llm.generate([text], GREEDY))
        assert _tokens(llm.generate([{"prompt": text}], GREEDY)) == by_text == base[:1]
        assert _tokens(llm.generate(text, GREEDY)) == by_text
        with pytest.raises(RequestError, match="exactly one of"):
            llm.generate([{"prompt": text, "prompt_token_ids": ids}], GREEDY)
        with pytest.raises(RequestError, match="token ids"):
            llm.generate([{"prompt_token_ids": [10**7]}], GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(text, GREEDY)


def _workers(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.executor.procs]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_tensor_parallel_llm_twice_in_one_process(path):
    kw = dict(dtype="float32", execution_mode="eager", tensor_parallel_size=2)
    with LLM(path, **kw) as first:
        want = _tokens(first.generate([[1, 2, 3], [40, 41]], GREEDY))
        pids = _workers(first)
    assert not any(_alive(p) for p in pids)
    with LLM(path, **kw) as second:  # refused before: the first one's process group was still up
        assert _tokens(second.generate([[1, 2, 3], [40, 41]], GREEDY)) == want
    third = LLM(path, **kw)  # never closed: collecting it frees its workers
    pids = _workers(third)
    del third
    gc.collect()
    assert not any(_alive(p) for p in pids)
    fourth = LLM(path, **kw)
    try:
        assert _tokens(fourth.generate([[1, 2, 3]], GREEDY)) == want[:1]
    finally:
        fourth.close()
