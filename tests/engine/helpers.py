"""Shared pieces of the engine tests: a batch of query spans over a paged KV cache, and the KV-leak check of
speculation tests."""

import torch


def span_batch(g: torch.Generator, lens: list[int], spans: list[int], nb: int, bs: int, blocks_per_seq: int,
               h: int, kvh: int, d: int, dtype: torch.dtype):
    """Sequence i has context lens[i], the last spans[i] positions of it new this step (a decode: 1, a
    verification: 1 + K, a prefill chunk: more). Returns attention_impl's arguments from q on:
    (q [T, H, D], k and v [T, KVH, D], slots, block tables [B, blocks_per_seq] (random blocks of nb, no block
    in two tables, as the engine's block manager hands them out: a slot written twice in one step would make the
    result depend on the order of the writes), seq_lens, query_start_loc), drawn from g in that order."""
    b, t = len(lens), sum(spans)
    assert b * blocks_per_seq <= nb, "disjoint tables need b * blocks_per_seq blocks"
    tables = torch.randperm(nb, generator=g)[: b * blocks_per_seq].view(b, blocks_per_seq)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k, v = (torch.randn(t, kvh, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs
                          for i in range(b) for p in range(lens[i] - spans[i], lens[i])])
    qsl = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()])
    return q, k, v, slots, tables, torch.tensor(lens), qsl


def assert_all_free(llm):
    """Speculation left nothing behind: the target's and the head's KV blocks all free, no head state."""
    eng = llm.engine
    eng.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks, "target KV blocks leaked"
    head = eng.proposer
    assert head.blocks.num_free == head.blocks.num_blocks, "head KV blocks leaked"
    assert not head.states, "head state kept for finished sequences"


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt` by exactly n tokens (end-of-sequence does not stop it): the
    reference the engine's float32 greedy tokens must equal."""
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def tp_engine(path, tp: int, **kw):
    """A float32 eager engine at --tensor-parallel-size tp with a 64-token step budget (prompts chunk), as the
    tensor-parallel tests build them; close it after (the `closing` fixture of tests/engine/conftest.py)."""
    from leverlab import LLM

    return LLM(str(path), dtype="float32", execution_mode="eager", tensor_parallel_size=tp,
               max_num_batched_tokens=64, **kw)
