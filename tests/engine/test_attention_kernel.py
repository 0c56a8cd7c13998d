"""The C++ paged decode kernel agrees with the PyTorch path (GQA, ragged lengths, sliding window)."""

import pytest
import torch

from leverlab.kernels import cpu_kernels
from leverlab.layers.attention import attention_impl
from leverlab.quant import kv_cache as kvq
from tests.engine.helpers import span_batch


def kv_caches(g, nb, bs, kvh, d, dtype, head_major):
    """Random K and V caches [nb, bs, kvh, d]: contiguous (slot-major), or stored head-major within a block as the
    engine allocates them (quant/kv_cache.py allocate); the kernel reads either through the strides."""
    shape = (nb, kvh, bs, d) if head_major else (nb, bs, kvh, d)
    kc, vc = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    return (kc.transpose(1, 2), vc.transpose(1, 2)) if head_major else (kc, vc)


# head_dim 32 takes the generic loops; 128 in bfloat16 the AVX-512 path where the CPU has one
@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_matches_pytorch_path(monkeypatch, dtype, tol, window, d, head_major):
    if cpu_kernels.kernels() is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(0)
    nb, bs, kvh, h, b = 40, 4, 2, 6, 5
    kc, vc = kv_caches(g, nb, bs, kvh, d, dtype, head_major)
    lens = torch.tensor([1, 7, 13, 4, 16])
    tables = torch.randperm(nb, generator=g)[: b * 4].view(b, 4)  # disjoint, as the block manager gives them
    q, k, v = torch.randn(b, h, d, generator=g).to(dtype), *(torch.randn(b, kvh, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.stack([tables[i, (lens[i] - 1) // bs] * bs + (lens[i] - 1) % bs for i in range(b)])
    args = (slots, tables, lens, torch.arange(b + 1), 0.3)
    ours = attention_impl(q, k, v, kc.clone(), vc.clone(), *args, window=window)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    ref = attention_impl(q, k, v, kc.clone(), vc.clone(), *args, window=window)
    assert torch.allclose(ours.float(), ref.float(), atol=tol, rtol=0)


# 64 and 256 in bfloat16: the AVX-512 path's value pass in row pairs (64; 3 rows a KV head, so pairs that straddle two
# queries) and row by row (256)
@pytest.mark.parametrize("d", [32, 64, 256])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_matches_pytorch_path_for_query_spans(monkeypatch, dtype, tol, window, d, head_major):
    """Verification steps: 1 + K queries per sequence, causal within the span, mixed with plain decodes."""
    if cpu_kernels.kernels() is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(1)
    nb, bs, kvh, h = 40, 4, 2, 6
    lens = [1, 9, 13, 5, 16, 4]
    spans = [1, 4, 5, 1, 3, 4]  # queries per sequence: the last `span` positions of its context
    kc, vc = kv_caches(g, nb, bs, kvh, d, dtype, head_major)
    q, k, v, *meta = span_batch(g, lens, spans, nb, bs, 4, h, kvh, d, dtype)
    args = (*meta, 0.3)
    ours = attention_impl(q, k, v, kc.clone(), vc.clone(), *args, window=window)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    ref = attention_impl(q, k, v, kc.clone(), vc.clone(), *args, window=window)
    assert torch.allclose(ours.float(), ref.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_writes_the_new_kv_into_its_slots(head_major):
    """The kernel path stores this step's K/V itself (no separate index_copy_): the cache afterwards holds
    them at their slots, as the PyTorch path leaves it, in either layout."""
    if cpu_kernels.kernels() is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(2)
    nb, bs, kvh, d, h = 8, 4, 2, 64, 4
    kc, vc = (c.zero_() for c in kv_caches(g, nb, bs, kvh, d, torch.bfloat16, head_major))
    q = torch.randn(2, h, d, generator=g).bfloat16()
    k, v = (torch.randn(2, kvh, d, generator=g).bfloat16() for _ in range(2))
    slots = torch.tensor([5, 22])
    attention_impl(q, k, v, kc, vc, slots, torch.tensor([[1], [5]]), torch.tensor([2, 3]), torch.arange(3), 0.1)
    blk, row = slots // bs, slots % bs
    assert torch.equal(kc[blk, row], k) and torch.equal(vc[blk, row], v)
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # nothing else written


@pytest.mark.parametrize("d", [32, 64, 128])  # 32: a head size the 64-wide value accumulators do not divide
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 37])
def test_tiled_long_spans_match_pytorch_path(monkeypatch, dtype, tol, window, d):
    """Prefill chunks in the kernel's register tiles: a prompt from scratch, a chunk after cached context and
    a decode in one batch, against SDPA over gathered K/V (in float32, which rounds less than bf16 SDPA)."""
    if cpu_kernels.kernels() is None or not cpu_kernels.kernels().has_tiled_attention():
        pytest.skip("no tiled attention in this build: prefill chunks take SDPA")
    g = torch.Generator().manual_seed(4)
    nb, bs, kvh, h = 64, 16, 2, 6
    lens = [70, 150, 33, 9]
    spans = [70, 61, 1, 9]  # from scratch; 89 cached + 61 new; a decode; a short prompt
    kc, vc = (torch.randn(nb, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    q, k, v, *meta = span_batch(g, lens, spans, nb, bs, 10, h, kvh, d, dtype)
    args = (*meta, d**-0.5)
    kc2, vc2 = kc.clone(), vc.clone()
    ours = attention_impl(q, k, v, kc, vc, *args, window=window)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    ref = attention_impl(q.float(), k.float(), v.float(), kc2.float(), vc2.float(), *args, window=window)
    assert torch.allclose(ours.float(), ref, atol=tol, rtol=0), (ours.float() - ref).abs().max()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [0, 45])
def test_a_decode_row_is_the_same_alone_batched_in_a_span_and_on_any_threads(d, window):
    """A query row's output must not depend on what else the step holds: the same bits decoded alone, beside
    another sequence, as one row of a verification span, and on one thread or two, in bf16 over a context of 100
    (six blocks of 16 positions, sliding window or not). This is what keeps batching and speculative decoding exact;
    a kernel that split long contexts (between threads, or in chunks merged after) must keep it."""
    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(7)
    nb, bs, kvh, h, ctx, n = 40, 16, 2, 6, 100, 5
    kc, vc = (torch.randn(nb, bs, kvh, d, generator=g).bfloat16() for _ in range(2))
    perm = torch.randperm(nb, generator=g)
    ours, other = perm[:7], perm[7:12]  # 112 and 80 positions
    q = torch.randn(n + 1, h, d, generator=g).bfloat16()

    def slot(table, p):
        return int(table[p // bs]) * bs + p % bs

    def run(seqs):
        """seqs: (table, context length, query rows of q); the new K/V written are the cache's own (no change)."""
        rows = [r for _, _, rs in seqs for r in rs]
        slots = [slot(t, c - len(rs) + j) for t, c, rs in seqs for j in range(len(rs))]
        knew, vnew = kc.view(-1, kvh, d)[slots].clone(), vc.view(-1, kvh, d)[slots].clone()
        tables = torch.stack([torch.cat([t, t.new_zeros(7 - len(t))]) for t, _, _ in seqs])
        qsl = torch.tensor([0, *torch.tensor([len(rs) for _, _, rs in seqs]).cumsum(0).tolist()])
        return kern.paged_decode(q[rows], knew, vnew, kc, vc, torch.tensor(slots), tables,
                                 torch.tensor([c for _, c, _ in seqs]), qsl, d**-0.5, window, None, None)

    threads = torch.get_num_threads()
    try:
        span = run([(ours, ctx, list(range(n)))])
        for j in range(n):
            alone = run([(ours, ctx - n + j + 1, [j])])
            batched = run([(other, 70, [n]), (ours, ctx - n + j + 1, [j])])
            torch.set_num_threads(1)
            one_thread = run([(ours, ctx - n + j + 1, [j])])
            torch.set_num_threads(max(2, threads))
            for got in (alone[0], batched[1], one_thread[0]):
                assert torch.equal(got, span[j]), f"row {j}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_either_cache_layout_gives_the_same_bits(cache):
    """The engine stores each block head-major (quant/kv_cache.py allocate); a contiguous tensor of the same
    logical shape is slot-major. Same contents, same bits out, new K/V written to the same logical places; int8
    scales laid out unlike their cache are refused with a clear error."""
    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(11)
    nb, bs, kvh, d, h, b, ctx = 24, 16, 4, 128, 8, 3, 70
    name = "int8" if cache == "int8" else "auto"
    caches, scales = kvq.allocate(name, torch.bfloat16, 1, nb, bs, kvh, d, "cpu")
    head = caches[0]
    assert head.stride(3) == bs * d and head.stride(2) == d  # [2, nb, bs, kvh, d], head-major within a block
    if cache == "int8":
        head.copy_(torch.randint(-127, 128, head.shape, generator=g, dtype=torch.int8))
        scales[0].copy_(torch.rand(scales[0].shape, generator=g) * 0.02)
    else:
        head.copy_(torch.randn(head.shape, generator=g).bfloat16())
    slot = head.contiguous()
    tables = torch.randperm(nb, generator=g)[: b * 5].view(b, 5)
    lens = torch.tensor([ctx, 33, 80])
    slots = torch.stack([tables[i, (lens[i] - 1) // bs] * bs + (lens[i] - 1) % bs for i in range(b)])
    q = torch.randn(b, h, d, generator=g).bfloat16()
    k, v = (torch.randn(b, kvh, d, generator=g).bfloat16() for _ in range(2))
    outs, after = [], []
    for src, s in ((head, scales[0] if scales else None), (slot, scales[0].contiguous() if scales else None)):
        c = src.clone()
        assert c.stride() == src.stride()  # clone keeps the layout under test
        extra = (s[0].clone(), s[1].clone()) if s is not None else (None, None)
        outs.append(kern.paged_decode(q, k, v, c[0], c[1], slots, tables, lens, torch.arange(b + 1), 0.1, 0, *extra))
        after.append((c, *(e for e in extra if e is not None)))
    assert torch.equal(outs[0], outs[1])
    for x, y in zip(*after):  # the new rows (and their scales) landed in the same logical slots
        assert torch.equal(x, y)
    if cache == "int8":
        with pytest.raises(RuntimeError, match="laid out as the cache"):
            kern.paged_decode(q, k, v, head[0], head[1], slots, tables, lens, torch.arange(b + 1), 0.1, 0,
                              scales[0][0].contiguous(), scales[0][1].contiguous())


@pytest.mark.parametrize("d", [64, 128])
def test_fresh_bf16_prefill_takes_the_amx_kernel_and_the_rest_the_tiles(d):
    """On a CPU with AMX a fresh bf16 span (its whole context new) of 64+ tokens is our AMX attention
    (amx_fresh_attention) on the new rows, bit for bit; a chunk after cached context, a short prompt and a decode
    in the same batch keep the tiled kernel (the same bits as with the AMX path switched off), and every new K/V
    lands in its slot either way."""
    kern = cpu_kernels.kernels()
    if kern is None or not kern.amx_bf16_enabled():
        pytest.skip("no AMX-BF16 on this CPU (or switched off): fresh prefill stays on the tiled kernel")
    g = torch.Generator().manual_seed(5)
    nb, bs, kvh, h = 64, 16, 2, 6
    lens, spans = [200, 150, 40, 9], [200, 61, 40, 1]  # fresh; 89 cached + 61 new; fresh but short; a decode
    kc, vc = (torch.randn(nb, bs, kvh, d, generator=g).bfloat16() for _ in range(2))
    q, k, v, *meta = span_batch(g, lens, spans, nb, bs, 13, h, kvh, d, torch.bfloat16)  # 13 blocks hold 200
    args = (*meta, d**-0.5)
    kc2, vc2 = kc.clone(), vc.clone()
    try:
        kern.set_amx_bf16(False)
        tiled = attention_impl(q, k, v, kc2, vc2, *args)
    finally:
        kern.set_amx_bf16(True)
    ours = attention_impl(q, k, v, kc, vc, *args)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    n = spans[0]
    direct = torch.empty_like(q[:n])
    kern.amx_fresh_attention(q[:n].contiguous(), k[:n].contiguous(), v[:n].contiguous(), direct, d**-0.5)
    assert torch.equal(ours[:n], direct)
    assert torch.equal(ours[n:], tiled[n:])
    assert (ours[:n].float() - tiled[:n].float()).abs().max() < 3e-2  # the tiles round less, not differently


@pytest.mark.parametrize("n,h,kvh,d", [(64, 2, 1, 64), (65, 6, 2, 64), (100, 4, 4, 128), (333, 16, 8, 128),
                                       (47, 3, 1, 32), (129, 8, 2, 256), (700, 6, 2, 64)])
def test_amx_fresh_attention_is_as_close_to_float64_as_flash_attention(n, h, kvh, d):
    """The AMX kernel (amx_attention.cpp) against causal attention in float64 on the same bf16 inputs: no further
    off than PyTorch's own bf16 flash attention (both round the probabilities to bf16 once), at any length
    (partial blocks of 16 and 32), any GQA ratio and head size; and the same bits on one thread or two."""
    kern = cpu_kernels.kernels()
    if kern is None or not kern.amx_attention_takes(d):
        pytest.skip("no AMX-BF16 on this CPU (or switched off): fresh prefill takes PyTorch's flash attention")
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, h, d, generator=g).bfloat16()
    k, v = (torch.randn(n, kvh, d, generator=g).bfloat16() for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
    exact = sdpa(qb.double(), kb.double(), vb.double(), is_causal=True, scale=d**-0.5, enable_gqa=True)
    flash = sdpa(qb, kb, vb, is_causal=True, scale=d**-0.5, enable_gqa=True)
    exact, flash = (t[0].transpose(0, 1) for t in (exact, flash))
    ours = torch.empty_like(q)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kern.amx_fresh_attention(q, k, v, ours, d**-0.5)
        torch.set_num_threads(2)
        two = torch.empty_like(q)
        kern.amx_fresh_attention(q, k, v, two, d**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ours, two)
    err, ref_err = ((t.double() - exact).abs().max().item() for t in (ours, flash))
    assert err <= ref_err * 1.25 + 1e-3, (err, ref_err)
