"""Tensor parallelism (leverlab/distributed): TP=2 against TP=1 on tiny checkpoints, float32, eager.

Each TP=2 engine starts one worker process (a few seconds: a fresh interpreter imports torch), so the tests
share engines where they can and always close them. Killing and stopping a worker checks that a failed rank
becomes a clear error within seconds, not a hang.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from leverlab import LLM, SamplingParams
from leverlab.errors import TensorParallelError, UnsupportedLever
from tests.engine.helpers import tp_engine as engine  # closing: the fixture in tests/engine/conftest.py

ARCHS = ("qwen3", "qwen2", "llama", "llama-tied", "mistral")
# Varied lengths: one token, a block and a bit, several blocks (chunked prefill with the small token budget),
# and more than mistral's 8-token window.
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [100, 3, 250, 17, 9, 31, 2, 8], list(range(40, 110))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_tokens_identical_to_tp1(checkpoint_factory, closing, arch):
    path = checkpoint_factory(arch)
    expected = tokens(engine(path, 1))
    llm = closing(path, 2)
    assert tokens(llm) == expected
    eng = llm.engine
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every KV block back
    c = eng.counter_snapshot()
    assert c["tp_steps"] == c["steps"] and c["tp_allreduces"] > 0 and c["tp_allreduce_seconds"] > 0
    # each rank holds half the KV heads: 2 KV heads over 2 ranks
    assert eng.runner.num_kv_heads == 1 and eng.runner.kv_caches[0].shape[-2] == 1


def test_kv_heads_replicated_when_fewer_than_ranks(checkpoint_factory, closing):
    path = checkpoint_factory("qwen3", num_key_value_heads=1)
    expected = tokens(engine(path, 1))
    llm = closing(path, 2)
    assert llm.engine.runner.num_kv_heads == 1
    assert tokens(llm) == expected


def test_int4_tp2_matches_tp1(checkpoint_factory, closing):
    """int4 quantizes each rank's slice; groups of 64 inputs never straddle the ranks' halves here, so the
    weights are the same as at TP=1 and only the order of the final sums differs."""
    path = checkpoint_factory("qwen3")
    expected = tokens(engine(path, 1, quantization="int4"))
    assert tokens(closing(path, 2, quantization="int4")) == expected


def test_int8_tp2_tokens_identical_to_tp1(checkpoint_factory, closing):
    """int8 scales are per output row; a row-parallel layer's rank takes them from the whole rows (recorded before
    its slice is cut), so every rank holds TP=1's int8 weights and, in float32, only the order of the sums differs."""
    path = checkpoint_factory("qwen3")
    expected = tokens(engine(path, 1, quantization="int8"))
    assert tokens(closing(path, 2, quantization="int8")) == expected


def test_draft_model_keeps_one_rank_while_the_target_runs_at_two(checkpoint_factory, closing):
    path = checkpoint_factory("qwen3")
    expected = tokens(engine(path, 1))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = closing(path, 2, speculative_config=spec)
    draft = llm.engine.proposer.runner
    assert draft.tp.size == 1 and draft.num_kv_heads == 2 and llm.engine.runner.num_kv_heads == 1
    assert tokens(llm) == expected
    assert llm.engine.counter_snapshot()["spec_accepted_tokens"] > 0


def test_eagle_head_at_one_rank_while_the_target_runs_at_two(checkpoint_factory, closing, tmp_path):
    """The head reads the target's embedding and output head, which are sharded at TP=2: it loads its own
    full copy and keeps degree 1; tokens stay identical to plain TP=1 decoding."""
    from tests.checkpoints import make_eagle_head

    path = checkpoint_factory("qwen3")
    expected = tokens(engine(path, 1))
    spec = {"method": "eagle", "model": make_eagle_head(path, tmp_path / "head"), "num_speculative_tokens": 3}
    llm = closing(path, 2, speculative_config=spec)
    assert tokens(llm) == expected
    assert llm.engine.counter_snapshot()["spec_draft_tokens"] > 0


def test_refuses_what_does_not_split(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    with pytest.raises(UnsupportedLever, match="num_attention_heads 4 is not divisible by 3"):
        engine(path, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        engine(path, 0)


def _worker_pid(llm: LLM) -> int:
    return llm.engine.executor.procs[0].pid


def test_killed_worker_fails_the_step_within_seconds(checkpoint_factory, closing):
    llm = closing(checkpoint_factory("qwen3"), 2)
    eng = llm.engine
    eng.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(_worker_pid(llm), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) died \(signal 9\)"):
        while time.monotonic() - t0 < 30:
            eng.step()
    assert time.monotonic() - t0 < 5
    assert not eng.healthy
    with pytest.raises(TensorParallelError):  # and it stays failed
        eng.step()


def test_idle_worker_death_turns_unhealthy(checkpoint_factory, closing):
    llm = closing(checkpoint_factory("qwen3"), 2)
    assert llm.engine.healthy
    os.kill(_worker_pid(llm), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while llm.engine.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.healthy
    with pytest.raises(TensorParallelError, match="died"):
        llm.generate([1, 2, 3], GREEDY)


def test_hung_worker_times_out(checkpoint_factory, closing, monkeypatch):
    monkeypatch.setenv("LEVERLAB_TP_STEP_TIMEOUT_S", "2")
    llm = closing(checkpoint_factory("qwen3"), 2)
    eng = llm.engine
    eng.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    eng.step()
    os.kill(_worker_pid(llm), signal.SIGSTOP)  # alive but not answering; close() kills it
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="collective failed"):
        while time.monotonic() - t0 < 30:
            eng.step()
    assert time.monotonic() - t0 < 10
    assert not eng.healthy
