"""The replica router's policy (engine/router.py), exactly: prefix affinity on the prefix cache's own block keys,
the balance slack, least loaded with turns, and forgetting a replica that left."""

from __future__ import annotations

from leverlab.core.block_manager import BlockManager, prefix_block_hashes
from leverlab.core.sequence import Sequence
from leverlab.engine.router import Router, RouterConfig
from leverlab.sampling_params import SamplingParams

BS = 4
SHARED = list(range(100, 112))  # three full blocks


def router(n=2, **kw) -> Router:
    return Router(RouterConfig(block_size=BS, **kw), n)


def test_keys_are_the_block_managers_own():
    """A prompt the cache has seen: the router's keys are exactly the hashes of the blocks it holds."""
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    prompt = SHARED + [7, 8]
    seq = Sequence(0, "r", 0, prompt, SamplingParams(max_tokens=1), None)
    bm.grow(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.commit_full_blocks(seq)
    assert prefix_block_hashes(prompt, BS, 32) == seq.block_hashes[:3] == router().keys(prompt)
    # the block holding the last prompt token is never reused, so never a key
    assert len(prefix_block_hashes(SHARED, BS, 32)) == 2
    assert router(affinity=False).keys(prompt) == []


def test_affinity_then_least_loaded_past_the_slack():
    r = router(balance_slack=2)
    a, b = r.keys(SHARED + [1]), r.keys(SHARED + [2])
    first = r.choose(a, [0, 1])
    r.record(a, first)
    r.start(first, 1, 10)
    assert r.choose(b, [0, 1]) == first  # shares three blocks with a request on `first`
    r.start(first, 2, 20)  # now 3 outstanding there, 0 on the other: past the slack of 2
    assert r.choose(b, [0, 1]) == 1 - first
    r.finish(first, 2, 20)
    assert r.choose(b, [0, 1]) == first and r.affinity_routed == 2
    assert r.choose(b, [1 - first]) == 1 - first  # its home out of rotation (full or dead)
    r.record(b, 1 - first)  # computed there too: both hold it now, the less loaded of the two serves it
    assert r.choose(b, [0, 1]) == 1 - first and r.affinity_routed == 3
    r.forget(1 - first)
    r.forget(first)  # its cache left with it: the least loaded (the other, 0 outstanding against 1) wins
    assert r.loads[first].seqs == 1 and r.choose(b, [0, 1]) == 1 - first
    assert r.affinity_routed == 3


def test_least_loaded_by_sequences_then_tokens_then_turns():
    r = router(n=3, affinity=False)
    r.start(0, 2, 10)
    r.start(1, 1, 500)
    r.start(2, 1, 50)
    assert r.choose([], [0, 1, 2]) == 2
    r.finish(0, 2, 10)
    r.finish(1, 1, 500)
    r.finish(2, 1, 50)
    assert sorted(r.choose([], [0, 1, 2]) for _ in range(3)) == [0, 1, 2]  # idle replicas take turns
