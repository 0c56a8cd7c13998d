"""KV-cache blocks: who owns which block, and which full blocks can be reused (automatic prefix caching).

The tensors live in the model runner; this file only does the accounting.

Prefix caching: a full block is keyed by a chain hash (parent block's hash, its own token ids). A new
sequence walks its prompt block by block and reuses every block whose key is cached AND whose stored token
ids equal its own (so a hash collision can never return wrong KV). A block whose last user finishes keeps
its KV and goes to the back of the free queue; allocation takes blocks from the front, so cached blocks are
evicted least-recently-freed first, and only when memory is needed.

Invariant (check()): free-and-empty + free-but-cached + in-use == num_blocks; an in-use block's ref_count
equals the number of live sequences holding it; num_cached_free counts the free blocks with a hash.

Threads: the engine thread alone changes this state; /metrics reads the counts from the server's event loop
thread between steps or during one, so they are kept as plain ints (reading one is atomic) rather than
recounted by iterating `free` (which raises "mutated during iteration" if the engine thread allocates then).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from leverlab.core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the cache
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the cache, and why the ones not served from it were missed."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # served from cache
    miss_new: int = 0  # no earlier occurrence after this prefix
    miss_partial: int = 0  # an earlier prompt shared them, but in a block that was never full (< one block)
    miss_evicted: int = 0  # they were cached once, and evicted for memory
    miss_last_block: int = 0  # cached, but a fully cached prompt recomputes its last block to get logits

    def as_counters(self) -> dict[str, int]:
        return {f"prefix_cache_{k}": v for k, v in vars(self).items()}


class BlockManager:
    MAX_HISTORY = 200_000  # prefixes remembered only to explain misses; forgotten past this

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks in eviction order (front = next to reuse). Dict as an ordered set.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self._cached_free = 0  # blocks in `free` whose hash is set (kept, not recounted: see Threads above)
        self.evicted: set[int] = set()  # hashes that were cached and evicted (to explain misses)
        self.children: dict[int | None, set[tuple[int, ...]]] = {}  # parent hash -> token ids seen after it
        self.stats = PrefixStats()

    # ---- counting -----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (empty ones and cached ones nobody uses)."""
        return len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold reusable prefix-cache KV."""
        return self._cached_free

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first num_tokens tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    # ---- allocation ---------------------------------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached KV
                self._cached_free -= 1
                del self.cached[block.hash]
                self.evicted.add(block.hash)
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)

    def release(self, seq: Sequence) -> None:
        # Tail blocks first: they are the least likely to be shared, so they should be evicted first.
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._unref(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_released_blocks = 0

    def release_before(self, seq: Sequence, position: int) -> None:
        """Sliding window: hand back the leading blocks that hold only positions < position. Their ids stay
        in the block table as placeholders (attention masks them out and never writes there)."""
        upto = min(position // self.block_size, len(seq.block_table))
        for i in range(seq.num_released_blocks, upto):
            self._unref(seq.block_table[i])
        seq.num_released_blocks = max(seq.num_released_blocks, upto)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            self._cached_free += block.hash is not None

    # ---- prefix caching -----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks of seq's longest cached prompt prefix; return how many tokens they hold.

        Only for a sequence with no blocks yet. At least one prompt token is always left to compute (its
        logits give the first output token), so a fully cached prompt recomputes its last block.
        """
        assert not seq.block_table
        if not self.caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed: no reuse for such requests
        bs, prompt = self.block_size, seq.prompt_token_ids
        full = (len(prompt) - 1) // bs
        parent: int | None = None
        hit = 0
        for i in range(full):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self._cached_free -= 1  # it has a hash: it was found in `cached`
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
            hit += bs
        if seq.num_cached_tokens is None:  # count each prompt once, not again after a preemption
            seq.num_cached_tokens = hit
            self._explain(prompt, hit, parent)
        return hit

    def _explain(self, prompt: list[int], hit: int, parent: int | None) -> None:
        """Classify the prompt tokens that were not served from cache (see PrefixStats)."""
        bs, n, s = self.block_size, len(prompt), self.stats
        s.queries += n
        s.hits += hit
        pos = hit
        while pos < n:
            tokens = tuple(prompt[pos : pos + bs])
            h = block_hash(parent, tokens)
            if len(tokens) == bs and h in self.cached:
                s.miss_last_block += bs
            elif len(tokens) == bs and h in self.evicted:
                s.miss_evicted += bs
            else:
                shared = max((_common(tokens, seen) for seen in self.children.get(parent, ())), default=0)
                s.miss_partial += shared
                s.miss_new += n - pos - shared
                break
            parent, pos = h, pos + len(tokens)
        # Remember this prompt's blocks (a partial tail too), so that later prompts can be explained.
        if len(self.children) > self.MAX_HISTORY:
            self.children.clear()
            self.evicted.clear()
        parent = None
        for i in range(0, n, bs):
            tokens = tuple(prompt[i : i + bs])
            self.children.setdefault(parent, set()).add(tokens)
            parent = block_hash(parent, tokens)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that have become full (all their tokens computed) in the cache."""
        if not self.caching:
            return
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids(i * bs, (i + 1) * bs))
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id
                self._cached_free += block.block_id in self.free  # a block a sliding window already released
                self.evicted.discard(h)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that nobody uses (for cold benchmark runs). Returns how many."""
        n = 0
        for block_id in self.free:
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
                n += 1
        self._cached_free = 0
        self.evicted.clear()
        self.children.clear()
        return n

    # ---- integrity ----------------------------------------------------------------------------------
    def check(self, live: list[Sequence]) -> None:
        held: dict[int, int] = {}
        for s in live:
            for b in s.block_table[s.num_released_blocks :]:
                held[b] = held.get(b, 0) + 1
        for b in self.blocks:
            assert b.ref_count == held.get(b.block_id, 0), f"block {b.block_id}: ref_count {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in self.free), f"block {b.block_id} free-list mismatch"
            if b.hash is not None:
                assert self.cached.get(b.hash) == b.block_id, f"block {b.block_id} hash not indexed"
        assert len(held) + len(self.free) == self.num_blocks, "blocks leaked"
        recount = sum(1 for b in self.free if self.blocks[b].hash is not None)
        assert self._cached_free == recount, f"num_cached_free {self._cached_free}, recounted {recount}"


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix cache's key of a full block: its parent's key and its own token ids. The replica router
    (engine/router.py) walks the same chain in the server's process to know which prompts share blocks; it
    compares keys only with keys of its own process (before Python 3.12, hash(None), the first block's
    parent, differs between processes), never with a replica's."""
    return hash((parent, tokens))


def prefix_block_hashes(prompt: list[int], block_size: int, limit: int) -> list[int]:
    """Chain keys of the prompt's first `limit` full blocks, as match_prefix looks them up (it never reuses
    the block holding the last prompt token, which is recomputed for its logits)."""
    out: list[int] = []
    parent = None
    for i in range(min(limit, (len(prompt) - 1) // block_size)):
        parent = block_hash(parent, tuple(prompt[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
