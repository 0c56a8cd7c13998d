"""Prefix caching: exact block ids, reuse, LRU eviction, miss reasons, and no change to a single token."""

import threading
import time

import pytest

from leverlab import LLM, SamplingParams
from leverlab.core.block_manager import BlockManager
from leverlab.core.sequence import Sequence

BS = 4


def seq(tokens, sid=0):
    return Sequence(sid, f"r{sid}", 0, list(tokens), SamplingParams(), None)


def admit(bm, s):
    """What the scheduler does: match the prefix, then grow to the whole prompt, then compute it."""
    s.num_computed_tokens = bm.match_prefix(s)
    bm.grow(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return s


def test_reuse_exact_block_ids_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = admit(bm, seq(range(10)))  # blocks 0,1 full (cached), 2 partial
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    b = admit(bm, seq(list(range(8)) + [99, 98], sid=1))  # shares two full blocks with a
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    bm.release(b)
    bm.release(a)
    # Freed tail-first, after the never-used blocks: eviction order is 4, 5, then 3, 2, 1, 0.
    assert list(bm.free) == [4, 5, 3, 2, 1, 0]
    c = admit(bm, seq(range(12), sid=2))  # hits blocks 0, 1; needs one new block for 8..11
    assert c.block_table == [0, 1, 4] and c.num_cached_tokens == 8
    d = admit(bm, seq([50 + i for i in range(12)], sid=3))  # a stranger takes 5, 3, 2: nothing cached in use
    assert d.block_table == [5, 3, 2]
    bm.check([c, d])
    bm.release(c)
    bm.release(d)
    # Cached blocks evicted only when needed: a long stranger forces out the oldest-freed ones first.
    e = admit(bm, seq([200 + i for i in range(20)], sid=4))
    assert e.block_table == [4, 1, 0, 2, 3]
    bm.release(e)
    f = admit(bm, seq(range(12), sid=5))  # all three of its blocks were cached once, then evicted
    assert f.num_cached_tokens == 0
    assert bm.stats.miss_evicted == 12


def test_cached_free_count_kept_and_readable_while_the_engine_allocates():
    """/metrics reads the block counts from another thread while the engine thread allocates and frees: they
    must stay exact and never raise (counting by iterating the free list raised "OrderedDict mutated during
    iteration" and dropped every gauge from a scrape under load)."""
    bm = BlockManager(num_blocks=512, block_size=BS, enable_prefix_caching=True)
    stop, errors, reads = threading.Event(), [], [0]

    def scrape():
        while not stop.is_set():
            try:
                assert 0 <= bm.num_cached_free <= bm.num_free <= bm.num_blocks
                reads[0] += 1
            except Exception as e:  # noqa: BLE001 - any error here is the failure
                errors.append(e)
                return

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    try:
        deadline, i = time.monotonic() + 0.5, 0
        while time.monotonic() < deadline:  # the engine's side: prompts sharing prefixes come and go
            live = [admit(bm, seq([j % 7 for j in range(k)] + [i, k], sid=i * 10 + k)) for k in range(4, 60, 5)]
            bm.check(live)  # includes the kept count against a recount
            for s in live:
                bm.release(s)
            i += 1
    finally:
        stop.set()
        t.join()
    assert not errors and reads[0] > 0, errors
    bm.check([])
    assert bm.num_cached_free == sum(bm.blocks[b].hash is not None for b in bm.free) > 0
    bm.reset_prefix_cache()
    assert bm.num_cached_free == 0


def test_collision_never_returns_wrong_blocks(monkeypatch):
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = admit(bm, seq(range(9)))
    bm.release(a)
    # Force a collision: pretend a different block hashed to the cached key.
    key = next(iter(bm.cached))
    block = bm.blocks[bm.cached[key]]
    block.token_ids = (7, 7, 7, 7)
    b = admit(bm, seq(range(9), sid=1))
    assert b.num_cached_tokens == 0


def test_fully_cached_prompt_recomputes_last_block():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    bm.release(admit(bm, seq(range(8))))
    again = seq(range(8), sid=1)
    assert bm.match_prefix(again) == 4  # one token must be computed for logits: the last block is redone
    assert bm.stats.miss_last_block == 4


def test_miss_reasons_match_the_workload():
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=True)
    system = list(range(100, 108))  # two full blocks shared by every request
    bm.release(admit(bm, seq(system + [1, 2, 3, 4, 5])))
    bm.release(admit(bm, seq(system + [1, 2, 9, 9, 9], sid=1)))
    s = bm.stats
    # First: all 13 new. Second: 8 hit; of 5 missed, 2 were shared with the first (a prefix < one block).
    assert (s.queries, s.hits, s.miss_partial, s.miss_new, s.miss_evicted) == (26, 8, 2, 16, 0)


def test_cache_off_never_reuses():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    bm.release(admit(bm, seq(range(9))))
    assert not admit(bm, seq(range(9), sid=1)).num_cached_tokens


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3")


def test_greedy_identical_with_cache_hits(path):
    shared = list(range(20, 60))
    prompts = [shared + [i, i + 1] for i in range(4)] + [shared]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = LLM(path, dtype="float32", enable_prefix_caching=False, block_size=8)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    warm = LLM(path, dtype="float32", enable_prefix_caching=True, block_size=8)
    first = warm.generate(prompts[:1], params)
    again = warm.generate(prompts, params)  # every prompt now hits the shared prefix
    assert [first[0].outputs[0].token_ids] + [o.outputs[0].token_ids for o in again][1:] == expected[:1] + expected[1:]
    assert all(o.metrics.num_cached_prompt_tokens >= 32 for o in again)
    eng = warm.engine
    eng.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_prompt_logprobs_complete_despite_cached_prefix(path):
    llm = LLM(path, dtype="float32", block_size=8)
    prompt = list(range(20, 60))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # now cached
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == len(prompt) and all(lp for lp in out.prompt_logprobs[1:])
