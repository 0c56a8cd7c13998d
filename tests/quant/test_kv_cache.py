"""--kv-cache-dtype int8 / fp8: per-(token, head) quantization, attention over it, memory, the engine."""

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.layers.attention import attention_impl
from leverlab.quant import kv_cache as kvq
from tests.engine.helpers import span_batch


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_write_then_gather_is_within_half_a_step_per_token_and_head(name):
    caches, scales = kvq.allocate(name, torch.float32, 1, 4, 16, 2, 64, "cpu")
    x = torch.randn(6, 2, 64)
    x[2, 1] *= 50  # one loud token-head must not coarsen the others
    slots = torch.tensor([0, 1, 5, 16, 33, 63])
    kvq.write(caches[0][0], scales[0][0], x, slots)
    got = kvq.gather(caches[0][0], scales[0][0], torch.arange(4), torch.float32).reshape(-1, 2, 64)[slots]
    step = x.abs().amax(-1, keepdim=True) / (127 if name == "int8" else 448)
    # int8: half a step; e4m3: relative 2^-4 of the value, or half the subnormal step near zero
    bound = step / 2 if name == "int8" else torch.maximum(x.abs() * 2**-4, step * 2**-9)
    assert ((got - x).abs() <= bound * 1.0001 + 1e-7).all()
    # a quiet token keeps its own fine scale (the loud one's int8 step would be ~1)
    assert (got[0] - x[0]).abs().max() < (0.05 if name == "int8" else 0.15)


def test_attention_over_int8_cache_equals_attention_over_its_dequantized_values():
    torch.manual_seed(0)
    H, KVH, D, bs, nb = 4, 2, 32, 4, 12
    caches, scales = kvq.allocate("int8", torch.float32, 1, nb, bs, KVH, D, "cpu")
    k_cache, v_cache = caches[0]
    ks, vs = scales[0]
    # Step 1: prefill two sequences (7 and 5 tokens); step 2: a decode token for the first, a chunk for the second.
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    steps = [([7, 5], [0, 0]), ([1, 3], [7, 5])]
    for new, cached in steps:
        t = sum(new)
        q, k, v = torch.randn(t, H, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for i, n in enumerate(new)
                              for p in range(cached[i], cached[i] + n)])
        lens = torch.tensor([c + n for c, n in zip(cached, new)])
        starts = torch.tensor([0, new[0], t])
        # Reference: a float cache holding exactly what the int8 cache will hold after this write.
        ref_k = kvq.gather(k_cache, ks, torch.arange(nb), torch.float32).clone()
        ref_v = kvq.gather(v_cache, vs, torch.arange(nb), torch.float32).clone()
        dq = [qx.float() * s[..., None] for qx, s in (kvq.quantize(k, torch.int8), kvq.quantize(v, torch.int8))]
        out = attention_impl(q, k, v, k_cache, v_cache, slots, tables, lens, starts, D**-0.5, k_scale=ks, v_scale=vs)
        ref = attention_impl(q, dq[0], dq[1], ref_k, ref_v, slots, tables, lens, starts, D**-0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_int8_cache_fits_about_twice_the_tokens(checkpoint_factory):
    path = checkpoint_factory("qwen3")  # head_dim 32: (32 + 4) bytes against 64 per token and head
    mem = 1 << 20
    auto = LLM(path, dtype="bfloat16", kv_cache_memory=mem)
    q8 = LLM(path, dtype="bfloat16", kv_cache_memory=mem, kv_cache_dtype="int8")
    assert q8.engine.runner.kv_caches[0].dtype == torch.int8
    ratio = q8.engine.runner.num_blocks / auto.engine.runner.num_blocks
    assert ratio == pytest.approx(64 / 36, rel=0.02)
    total = sum(t.numel() * t.element_size() for t in q8.engine.runner.kv_caches + q8.engine.runner.kv_scales)
    assert total <= mem


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_engine_with_quantized_kv_cache_tracks_the_float_cache(checkpoint_factory, name):
    path = checkpoint_factory("qwen3")
    prompts = [list(range(10, 47)), list(range(10, 30)) + [3, 4], [7, 8, 9]]  # shared prefix: prefix cache hits
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    base = LLM(path, dtype="float32", max_num_batched_tokens=16).generate(prompts, params)  # chunked prefill
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, kv_cache_dtype=name)
    outs = llm.generate(prompts, params)
    tol = 0.05 if name == "int8" else 0.3
    assert len(outs[0].prompt_logprobs) == 37  # the first prompt's logprobs are all compared
    for o, b in zip(outs, base):
        diffs = [abs(lp[t].logprob - lb[t].logprob) for lp, lb, t in zip(o.prompt_logprobs[1:], b.prompt_logprobs[1:],
                                                          o.prompt_token_ids[1:])]
        # (a prompt that hits the prefix cache comes back without prompt logprobs: engine behaviour, not ours)
        assert not diffs or max(diffs) < tol, max(diffs)
        same = sum(a == c for a, c in zip(o.outputs[0].token_ids, b.outputs[0].token_ids))
        assert same >= 8  # first tokens agree; greedy paths may part later
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("d", [32, 64, 128, 256])  # 32: the generic loops; else the AVX2 or AVX-512 int8 path
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 3])
def test_cpp_kernel_over_int8_cache_matches_the_gather_path(monkeypatch, d, dtype, tol, window):
    """The C++ kernel quantizes the new K/V exactly as kv_cache.write does (same bytes, same scales) and its
    attention, dequantizing in registers, agrees with gathering and dequantizing; decode and verification
    spans mixed, GQA."""
    from leverlab.kernels import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(3)
    nb, bs, kvh, h = 40, 4, 2, 6
    lens = [1, 9, 13, 5, 16, 4]
    spans = [1, 4, 5, 1, 1, 2]
    caches, scales = kvq.allocate("int8", dtype, 1, nb, bs, kvh, d, "cpu")
    (kc, vc), (ks, vs) = caches[0], scales[0]
    for c, s in ((kc, ks), (vc, vs)):  # a filled context to attend over
        kvq.write(c, s, torch.randn(nb * bs, kvh, d, generator=g), torch.arange(nb * bs))
    q, k, v, *meta = span_batch(g, lens, spans, nb, bs, 4, h, kvh, d, dtype)
    args = (*meta, 0.3)
    state = [x.clone() for x in (kc, vc, ks, vs)]
    ours = attention_impl(q, k, v, kc, vc, *args, k_scale=ks, v_scale=vs, window=window)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    rk, rv, rks, rvs = state
    # The reference in float32 (the same bf16 inputs, widened): the gather path's bf16 matmuls round more than ours.
    ref = attention_impl(q.float(), k.float(), v.float(), rk, rv, *args, k_scale=rks, v_scale=rvs, window=window)
    assert torch.equal(kc, rk) and torch.equal(vc, rv) and torch.equal(ks, rks) and torch.equal(vs, rvs)
    assert torch.allclose(ours.float(), ref.float(), atol=tol, rtol=0), (ours.float() - ref.float()).abs().max()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["flat", "peaked"])
def test_int16_attention_over_int8_cache_is_within_bfloat16_rounding_on_long_contexts(monkeypatch, d, kind):
    """bfloat16 activations over an int8 cache take the integer path (16-bit queries and weights, int32 sums;
    item_q8_vnni where the CPU has AVX-512 VNNI). Over 2,500 positions of V near +1 with flat attention, 16-bit
    weights at full scale would overflow the int32 sums ~5x over; the weights' scale must bound them. Peaked
    attention (loud queries) checks the fine steps. Both within a bfloat16 output's rounding of float32 math."""
    from leverlab.kernels import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("no C++ compiler here: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(5)
    nb, bs, kvh, h = 330, 16, 2, 6
    lens, spans = [2500, 2501], [1, 3]
    caches, scales = kvq.allocate("int8", torch.bfloat16, 1, nb, bs, kvh, d, "cpu")
    (kc, vc), (ks, vs) = caches[0], scales[0]
    kvq.write(kc, ks, torch.randn(nb * bs, kvh, d, generator=g), torch.arange(nb * bs))
    kvq.write(vc, vs, 1 + 0.05 * torch.randn(nb * bs, kvh, d, generator=g), torch.arange(nb * bs))
    q, k, v, *meta = span_batch(g, lens, spans, nb, bs, 160, h, kvh, d, torch.bfloat16)
    q = torch.zeros_like(q) if kind == "flat" else q * 4
    state = [x.clone() for x in (kc, vc, ks, vs)]
    ours = attention_impl(q, k, v, kc, vc, *meta, d**-0.5, k_scale=ks, v_scale=vs)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    rk, rv, rks, rvs = state
    ref = attention_impl(q.float(), k.float(), v.float(), rk, rv, *meta, d**-0.5, k_scale=rks, v_scale=rvs)
    err = (ours.float() - ref).abs()
    assert (err <= 2**-8 * ref.abs() + 2e-4).all(), err.max()  # 2^-8: the output's own rounding to bfloat16
