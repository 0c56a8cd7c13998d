"""LLM(data_parallel_size=2) (engine/replicas.py) with the other levers on: each replica a whole engine process.

DP=2 x TP=2 (two replicas of two ranks each: four processes) with int4 weights and n-gram speculation gives,
in float32 greedy decoding, the tokens of one plain engine with the same levers; both replicas serve, and
every KV block is free after. (int4 at TP=2 keeps TP=1's weights here: tests/engine/test_tensor_parallel.py.)
"""

from __future__ import annotations

import time

import pytest

from leverlab import LLM, SamplingParams
from leverlab.errors import UnsupportedLever

REPEATING = [5, 6, 7, 8] * 4  # n-gram speculation finds drafts in it
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), REPEATING, [100, 3, 250, 17, 9, 31, 2, 8], list(range(40, 110))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LEVERS = dict(dtype="float32", execution_mode="eager", quantization="int4", max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def settled(llm: LLM, timeout: float = 15.0):
    """The replicas' stats once every KV block is back (a replica reports after its outputs)."""
    deadline = time.monotonic() + timeout
    while True:
        st = llm.engine.stats()
        if st.num_free_blocks == st.num_total_blocks or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_dp2_tp2_int4_ngram_tokens_identical_to_one_engine(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    with LLM(path, **LEVERS) as one:
        expected = tokens(one)
    with LLM(path, data_parallel_size=2, tensor_parallel_size=2, **LEVERS) as llm:
        assert tokens(llm) == expected
        assert [o.outputs[0].token_ids for o in llm.stream(REPEATING, GREEDY)][-1] == expected[2]
        st = settled(llm)
        assert st.num_free_blocks == st.num_total_blocks > 0
        per = {i: s.counters for i, alive, s in st.replicas if alive}
        assert sorted(per) == [0, 1] and all(c["requests_finished"] > 0 for c in per.values())  # both served
        assert st.counters["tp_steps"] == st.counters["steps"] > 0  # every step of both went over its ranks
        assert st.counters["spec_draft_tokens"] > 0 and llm.engine.quantization == "int4"


def test_refusals_are_clear(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM(path, data_parallel_size=0)
    with pytest.raises(UnsupportedLever, match="not built"):
        LLM(path, data_parallel_size=2, nnodes=2, tensor_parallel_size=2, master_port=1)
