"""AsyncLLM's hand-off and failure paths, in-process on a tiny checkpoint: a slow consumer gets coalesced
cumulative outputs (the latest state, the final one complete), and a loop that dies fails every stream and
every pending command at once (nothing waits for ever)."""

from __future__ import annotations

import asyncio

import pytest

from leverlab.config import EngineConfig
from leverlab.engine.async_engine import AsyncLLM
from leverlab.errors import EngineDeadError
from leverlab.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _engine(path) -> AsyncLLM:
    return AsyncLLM(EngineConfig(model=str(path), dtype="float32", execution_mode="eager", num_kv_blocks=32))


def test_slow_consumer_gets_coalesced_outputs(checkpoint_factory):
    """A consumer that takes nothing while the engine runs the rest of its 24 steps then gets one output holding
    all of them. (Counted against a consumer that reads as fast as it can, this had stopped being a test: the
    engine now runs the whole request before a fast reader's first turn too.)"""
    path = checkpoint_factory("qwen3")

    async def main():
        eng = _engine(path)
        try:
            fast = [o async for o in eng.generate([1, 2, 3], PARAMS, "fast")]
            stream = eng.generate([1, 2, 3], PARAMS, "slow")
            outs = [await anext(stream)]  # the first (or, if the engine was quicker, the final) output
            deadline = asyncio.get_running_loop().time() + 30
            while eng.stats().counters["requests_finished"] < 2:  # the engine goes on without the reader
                assert asyncio.get_running_loop().time() < deadline, "the request did not finish"
                await asyncio.sleep(0.01)
            outs += [o async for o in stream]
            return fast, outs, eng.stats()
        finally:
            await eng.shutdown(1.0)

    fast, outs, stats = asyncio.run(main())
    assert len(outs) <= 2  # coalesced, not queued: a queue would hold one output per step
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == fast[-1].outputs[0].token_ids
    assert len(outs[-1].outputs[0].logprobs) == 24
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_dead_loop_fails_streams_and_commands(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("qwen3")
    monkeypatch.setenv("LEVERLAB_TEST_FAIL_AT_STEP", "3")

    async def main():
        eng = _engine(path)
        try:
            with pytest.raises(EngineDeadError, match="injected"):
                async for _ in eng.generate([1, 2, 3], PARAMS, "a"):
                    pass
            assert not eng.healthy
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(eng.reset_prefix_cache(), 5)  # answered, not hung
            with pytest.raises(EngineDeadError):
                async for _ in eng.generate([1, 2, 3], PARAMS, "b"):
                    pass
        finally:
            await eng.shutdown(0)

    asyncio.run(main())
