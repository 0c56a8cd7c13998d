"""Batching, chunked prefill and preemption must not change a single token (float32, greedy)."""

import pytest

from leverlab import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (3, 40, 17, 1, 70, 9)]


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module")
def alone(path):
    llm = LLM(path, dtype="float32", max_num_seqs=1)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def run(path, prompts=PROMPTS, **kw):
    llm = LLM(path, dtype="float32", **kw)
    outs = llm.generate(prompts, GREEDY)
    eng = llm.engine
    eng.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], eng


def test_batched_equals_alone(path, alone):
    tokens, _ = run(path)
    assert tokens == alone


def test_chunked_prefill_equals_unchunked(path, alone):
    # A 16-token budget splits the 40- and 70-token prompts into chunks mixed with other sequences' decodes.
    tokens, _ = run(path, max_num_batched_tokens=16)
    assert tokens == alone


def test_preemption_under_tiny_kv_pool(path, alone):
    # 12 blocks of 4 tokens: the 70-token prompt alone needs most of the pool, so sequences get preempted.
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_every_request_accounted_for(path):
    llm = LLM(path, dtype="float32", max_num_seqs=3, max_num_batched_tokens=20)
    prompts = [[i + 1] * (1 + i % 7) for i in range(20)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert not llm.engine.requests and not llm.engine.scheduler.has_work()


def test_kv_cache_sizing_by_bytes_and_fraction(path):
    from leverlab.worker.model_runner import free_memory

    by_bytes = LLM(path, dtype="float32", kv_cache_memory=1 << 20, block_size=16, max_num_seqs=512).engine
    per_block = by_bytes.runner.kv_bytes_per_token() * 16
    assert by_bytes.blocks.num_blocks == (1 << 20) // per_block
    frac = LLM(path, dtype="float32", kv_cache_memory_fraction=0.001, block_size=16).engine
    expected = int(0.001 * free_memory(frac.runner.device)) // per_block
    assert abs(frac.blocks.num_blocks - expected) <= 0.2 * expected
