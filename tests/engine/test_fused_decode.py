"""The fused decode path (models/fused.py, one C++ forward per short step) against the module path."""

import time

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.kernels import cpu_kernels
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.models import fused
from leverlab.models.loader import load_model
from tests.checkpoints import ARCHS

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="C++ kernels not built here")
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [100, 3, 250, 17, 9, 31, 2, 8]]


def both_paths(model, dtype, spans, context=20):
    """Run the same steps (each sequence `context` cached tokens, then a span of new ones) through the modules
    and the fused forward, each on its own copy of one random KV cache. Returns the two hidden tensors."""
    cfg = model.config
    torch.manual_seed(0)
    bs, nseq = 16, len(spans)
    per_seq = -(-(context + max(spans)) // bs)
    base = [torch.randn(2, nseq * per_seq, bs, cfg.num_kv_heads, cfg.head_dim).to(dtype) for _ in range(cfg.num_layers)]
    tables = torch.arange(nseq * per_seq).view(nseq, per_seq)
    ids, positions, slots, starts = [], [], [], [0]
    for b, n in enumerate(spans):
        ids += torch.randint(0, cfg.vocab_size, (n,)).tolist()
        for p in range(context, context + n):
            positions.append(p)
            slots.append(int(tables[b, p // bs]) * bs + p % bs)
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(torch.tensor(slots), tables, torch.tensor([context + n for n in spans]),
                             torch.tensor(starts), max(spans))
    ids, positions = torch.tensor(ids), torch.tensor(positions)
    module_caches = [c.clone() for c in base]
    fused_caches = [c.clone() for c in base]
    with torch.no_grad(), forward_context(meta, module_caches):
        expected = model(ids, positions)
    dec = fused.fused_decoder(model, fused_caches, "auto", 1)
    assert dec is not None
    got = dec(ids, positions, meta)
    for a, b in zip(module_caches, fused_caches):  # the new K/V went to the same slots
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    return expected, got


@pytest.mark.parametrize("arch", (*ARCHS, "mistral", "qwen2-window"))
def test_fused_forward_matches_modules_float32(checkpoint_factory, arch):
    model = load_model(checkpoint_factory(arch), "float32")
    spans_list = [[1], [1, 1, 1], [4, 1, 16]]  # decode, a decode batch, verification spans and a short chunk
    if cpu_kernels.kernels().has_tiled_attention():
        spans_list.append([1, 45])  # a prefill chunk beside a decode: the fused path takes it where attention tiles
    for spans in spans_list:
        expected, got = both_paths(model, torch.float32, spans)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fused_forward_close_in_bfloat16(checkpoint_factory):
    model = load_model(checkpoint_factory("qwen3"), "bfloat16")
    expected, got = both_paths(model, torch.bfloat16, [1, 3])
    logits_e, logits_g = model.compute_logits(expected), model.compute_logits(got)
    assert (logits_e - logits_g).abs().max() < 0.1 * logits_e.abs().max()


def test_fused_forward_returns_eagle_aux_layers(checkpoint_factory):
    """With EAGLE's feature layers set, the fused forward returns (hidden, aux) as the modules do, in float32."""
    model = load_model(checkpoint_factory("qwen3"), "float32")
    model.aux_layers = (0, 1)
    (h_e, aux_e), (h_g, aux_g) = both_paths(model, torch.float32, [1, 3])
    assert aux_g.shape == aux_e.shape == (4, 2 * model.config.hidden_size)
    torch.testing.assert_close(h_g, h_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux_g, aux_e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,kv", [("qwen3", "auto"), ("qwen2", "auto"), ("qwen3", "int8")])
def test_engine_tokens_identical_with_and_without_fused_path(checkpoint_factory, monkeypatch, arch, kv):
    path = checkpoint_factory(arch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, dtype="float32", kv_cache_dtype=kv)
    assert llm.engine.runner.fused is not None
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.runner.fused_steps > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    monkeypatch.setenv("LEVERLAB_NO_FUSED_DECODE", "1")
    plain = LLM(path, dtype="float32", kv_cache_dtype=kv)
    assert plain.engine.runner.fused is None
    ref = plain.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_int8_head_takes_batches_past_its_streaming_rows_in_the_fused_step(checkpoint_factory, monkeypatch):
    """An int8 model's head (int8, with the int8 GEMM beside its streaming kernel) takes a decode batch of any size
    in the fused step, on the kernel the module path would use there: the module path's tokens and logprobs in
    float32 (in bf16 the fused step's hidden states round apart from the modules' at long contexts anyway)."""
    dtype = "float32"
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "2")
    path = checkpoint_factory("qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm = LLM(path, dtype=dtype, quantization="int8")
    assert llm.engine.runner.model.lm_head.quant_method is not None
    assert llm.engine.runner.fused.takes_head(len(PROMPTS))
    outs = llm.generate(PROMPTS, params)
    monkeypatch.setenv("LEVERLAB_NO_FUSED_DECODE", "1")
    ref = LLM(path, dtype=dtype, quantization="int8").generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    for o, r in zip(outs, ref):
        for got, want in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert [got[t].logprob for t in got] == pytest.approx([want[t].logprob for t in got], abs=1e-4)


def test_prefill_takes_the_fused_path_where_attention_tiles(checkpoint_factory):
    """A 200-token prompt is one fused call (no module dispatch per op), with the module path's tokens."""
    if not cpu_kernels.kernels().has_tiled_attention():
        pytest.skip("this CPU has no AVX2: attention does not tile long spans, prefill stays on the modules")
    path = checkpoint_factory("qwen3")
    llm = LLM(path, dtype="float32")
    before = llm.engine.runner.fused_steps
    prompt = [(7 * i) % 300 + 3 for i in range(200)]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert llm.engine.runner.fused_steps - before == 1
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    ref = LLM(path, dtype="float32")
    ref.engine.runner.fused.max_span = fused.MAX_SPAN  # the module path for the prefill, as before
    before = ref.engine.runner.fused_steps
    again = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert ref.engine.runner.fused_steps == before
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids


def test_int4_model_with_an_int6_head_decodes_through_the_fused_step(checkpoint_factory, monkeypatch):
    """An int4 model of whole-quad width with an int6 head (the default in bf16 where that kernel streams): the
    fused step runs it (kind 4), and greedy decoding in float32 gives the module path's tokens, blocks all freed."""
    path = checkpoint_factory("qwen3", hidden_size=128, intermediate_size=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, dtype="float32", quantization="int4", lm_head_quantization="int6")
    head = llm.engine.runner.model.lm_head
    assert head.quant_method.name == "int6" and head.quant_method.fused_weights(head)[0] == 4
    assert llm.engine.runner.fused is not None
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.runner.fused_steps > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    monkeypatch.setenv("LEVERLAB_NO_FUSED_DECODE", "1")  # the module path: compute_logits through Int6Method.apply
    plain = LLM(path, dtype="float32", quantization="int4", lm_head_quantization="int6")
    assert plain.engine.runner.fused is None
    ref = plain.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    # By default (auto) in bf16: int6 where its kernel streams, int8 elsewhere.
    head = load_model(path, "bfloat16", quantization="int4").lm_head
    assert head.quant_method.name == ("int6" if cpu_kernels.kernels().has_int6_stream() else "int8")


def test_fused_path_declines_what_it_does_not_run(checkpoint_factory):
    path = checkpoint_factory("qwen3")
    assert LLM(path, dtype="float32", kv_cache_dtype="fp8").engine.runner.fused is None  # no AVX2 fp8 decode
    assert LLM(path, dtype="float32", quantization="fp8").engine.runner.fused is None  # no fused fp8 kernel


@pytest.mark.parametrize("method", ("int8", "int4", "int4-g32", "int6"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_fused_forward_matches_modules_quantized(checkpoint_factory, method, dtype, monkeypatch):
    """The quantized layers' streaming kernels, called from C++ and from the modules, agree. Every layer streams
    (LEVERLAB_STREAM_ROWS): chosen by timing at load, the module path could take fbgemm's per-row activation
    quantization for a few rows (it did under load), which is a different product. int6 takes rows in whole
    128-weight quads: a wider checkpoint."""
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "16")
    wide = {"hidden_size": 128, "intermediate_size": 256} if method == "int6" else {}
    model = load_model(checkpoint_factory("qwen2", **wide), str(dtype).split(".")[1], quantization=method)
    expected, got = both_paths(model, dtype, [1, 2, 1])
    tol = 1e-5 if dtype == torch.float32 else 3e-2 * expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=tol, rtol=1e-5 if dtype == torch.float32 else 0)


def test_int4_interleaved_rows_through_the_fused_step(checkpoint_factory, monkeypatch):
    """On AVX2 without AVX-512 VNNI, an int4 model in bf16 whose layers are whole 256-channel steps wide holds its
    weights as interleaved rows (pack_int4_interleaved, its int6 head pack_int6_interleaved); the fused step and the
    modules agree on them, for 1 and 2 rows, and the bytes a step reads (the layers' and the fused step's own
    count, scripts/profile_step.py's) take in the scales read beside them."""
    from leverlab.quant.layouts import is_interleaved

    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "16")
    model = load_model(checkpoint_factory("qwen2", hidden_size=256, intermediate_size=512), "bfloat16",
                       quantization="int4")
    down = model.model.layers[0].mlp.down_proj
    assert is_interleaved(down.kernel_state.stream[0]) == cpu_kernels.kernels().has_int4_interleaved()
    panels = down.kernel_state.stream[0].dim() == 3 and not is_interleaved(down.kernel_state.stream[0])  # AVX-512 VNNI: scales inside the panels
    beside = 0 if panels else down.kernel_state.stream[1].numel() * 2
    assert down.quant_method.bytes_read(down, 1) == down.kernel_state.stream[0].numel() + beside
    head = model.lm_head  # int6 where its kernel streams (the default for int4 in bf16): interleaved alike
    if head.quant_method.name == "int6":
        assert (head.kernel_state.stream[0].dim() == 3 and head.kernel_state.stream[0].shape[2] == 192) == cpu_kernels.kernels().has_int4_interleaved()
    expected, got = both_paths(model, torch.bfloat16, [1, 2, 1])
    torch.testing.assert_close(got, expected, atol=3e-2 * expected.abs().max().item(), rtol=0)
    dec = fused.fused_decoder(model, [torch.zeros(1)] * model.config.num_layers, "auto", 1).dec
    layers = model.model.layers
    read = {"down": sum(x.mlp.down_proj.quant_method.bytes_read(x.mlp.down_proj, 1) for x in layers),
            "head": head.quant_method.bytes_read(head, 1)}
    assert {k: v for k, v in dec.phase_bytes() if k in read} == read


@pytest.mark.parametrize("method", ("int8", "int4"))
@pytest.mark.parametrize("arch", ("qwen2", "qwen3"))
def test_fused_forward_takes_fbgemm_past_the_streaming_rows(checkpoint_factory, method, arch, monkeypatch):
    """Past a layer's streaming rows the fused step calls the int8 GEMM from C++ (fbgemm's, op for op as the module
    path does, or on AMX CPUs our AMX kernel: quant/int8_gemm.py): the same bf16 result, bit for bit, and the fused
    path takes steps of any size. On AMX the fused step takes SiLU(gate) * up on the gate_up GEMM's outputs in L1
    (amx_int8_grouped): the same bits as the GEMM's output tensor and a pass of its own."""
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "2")
    model = load_model(checkpoint_factory(arch), "bfloat16", quantization=method)
    dec = fused.fused_decoder(model, [torch.zeros(1)] * model.config.num_layers, "auto", 1)
    assert dec is not None and dec.max_tokens is None
    expected, got = both_paths(model, torch.bfloat16, [3, 1, 5])  # 9 rows: every layer past its 2
    assert torch.equal(got, expected)
    # 70 rows: three blocks of 32 activation rows, so the AMX GEMMs hand each block's epilogue to the next one
    # (amx_int8.cpp Pipeline) and the grouped gate_up alternates its two group outputs
    expected, got = both_paths(model, torch.bfloat16, [33, 2, 35])
    assert torch.equal(got, expected)
    expected, got = both_paths(model, torch.bfloat16, [1, 1])  # at its 2 rows, the streaming kernels as before
    torch.testing.assert_close(got, expected, atol=3e-2 * expected.abs().max().item(), rtol=0)


def test_fused_prefill_of_an_int8_model_matches_modules_float32(checkpoint_factory, monkeypatch):
    """float32 through the same path (on AMX: the grouped GEMM with SiLU(gate) * up on its outputs in L1): the
    modules' values to float32 rounding."""
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "2")
    model = load_model(checkpoint_factory("qwen3"), "float32", quantization="int8")
    expected, got = both_paths(model, torch.float32, [3, 1, 40])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_int8_kernel_matches_dequantized_weight():
    kern = cpu_kernels.kernels()
    torch.manual_seed(0)
    for m in (1, 3, 8, 9):
        for n, k in ((64, 48), (37, 100), (128, 384)):
            x = torch.randn(m, k)
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            s, b = torch.rand(n) / 100, torch.randn(n)
            expected = x @ (w.float() * s[:, None]).t() + b
            torch.testing.assert_close(kern.int8_linear(x, w, s, b), expected, atol=1e-4, rtol=1e-4)
            got16 = kern.int8_linear(x.bfloat16(), w, s, None).float()
            assert (got16 - (expected - b)).abs().max() < 0.02 * expected.abs().max()


def quantize_blocks_q8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What the kernels' integer path multiplies: x [M, K] quantized per `block` elements to int8 (scale
    max|x| / 127, round half to even), dequantized back to float32. int8 and int4 with groups of 32 quantize x per
    32 (llama.cpp's q8_0), int4 and int6 with groups of 64 or more per 64."""
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_quantized_kernels_integer_path_is_the_block_quantized_product(dtype):
    """bf16/fp16 activations: the int8 (quantize_x) and int4 kernels compute exactly the dequantized weight times
    the per-32-block quantized activations (llama.cpp's q8_0 arithmetic; int4 with groups of 64 or more per
    64-block), up to float summation order and the output's rounding, for every row count they stream (one row;
    2..16 in tiles of 2 weight rows x up to 4), with odd block counts (int4 takes blocks in pairs, or fours with
    AVX-512: 1056, 1088 and 1120 leave 1, 2 and 3 over), group counts that fill no whole vector of 8 or 16 (and,
    in AVX-512's single stream, whole chunks of 16 groups with a partial one after them, at every group size: 1536
    and 2048 with g = 64, 128; in AVX2's, 8 groups of 64 and a partial chunk: 1088 and 1536), and an odd row count
    (the tiles' last single row). int6 with groups of 64 likewise where it streams (has_int6_stream): on AVX2 its
    single stream takes four groups at a time and the rest one by one (384: 4 + 2 groups), row by row."""
    from leverlab.quant.layouts import (
        dequantize_int6_streaming,
        dequantize_streaming,
        pack_int4_streaming,
        pack_int6_streaming,
        quantize_int4,
        quantize_int6,
    )

    kern = cpu_kernels.kernels()
    torch.manual_seed(0)
    for m in (1, 2, 3, 5, 16):
        for n, k in ((64, 64), (37, 384), (96, 1024), (41, 96), (8, 1056), (5, 1088), (6, 1120), (4, 1536),
                     (3, 2048), (2, 4096)):
            x = (torch.randn(m, k) * torch.rand(1, k) * 4).to(dtype)
            xq = quantize_blocks_q8(x)
            w, b = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.randn(n)
            s = torch.rand(n) / 100
            expected = xq @ (w.float() * s[:, None]).t() + b
            got = kern.int8_linear(x, w, s, b, True).float()
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max() + 2 ** -8 * expected.abs().max()
            for g in (g for g in (32, 64, 128, 256) if k % g == 0):
                q, sc, z = quantize_int4(torch.randn(n, k), g)
                packed, ss = pack_int4_streaming(q, sc, z, g)
                expected = (xq if g == 32 else quantize_blocks_q8(x, 64)) @ dequantize_streaming(packed, ss).t() + b
                got = kern.int4_linear(x, packed, ss, g, b).float()
                assert (got - expected).abs().max() <= 2 ** -7 * expected.abs().max(), (m, n, k, g)
            if k % 128 == 0 and kern.has_int6_stream():  # int6 (groups of 64), in whole 128-weight quads
                q, sc, z = quantize_int6(torch.randn(n, k), 64)
                packed, ss = pack_int6_streaming(q, sc, z, 64)
                expected = quantize_blocks_q8(x, 64) @ dequantize_int6_streaming(packed, ss).t() + b
                got = kern.int6_linear(x, packed, ss, 64, b).float()
                assert (got - expected).abs().max() <= 2 ** -7 * expected.abs().max(), (m, n, k, "int6")


def test_int4_kernel_matches_dequantized_weight():
    """float32 activations: exact against the weight the packed form encodes, which is RTN's within fp16's
    rounding of the scales."""
    from leverlab.quant.layouts import (
        dequantize_int4,
        dequantize_streaming,
        pack_int4_streaming,
        quantize_int4,
    )

    kern = cpu_kernels.kernels()
    torch.manual_seed(0)
    for m in (1, 3, 8, 9):
        for n, k, g in ((64, 64, 32), (37, 128, 64), (96, 384, 128)):
            x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
            q, s, z = quantize_int4(w, g)
            packed, ss = pack_int4_streaming(q, s, z, g)
            w16 = dequantize_streaming(packed, ss)
            rtn = dequantize_int4(q, s, z, g)
            assert ((w16 - rtn).abs() <= 15 * 2 ** -11 * s.repeat_interleave(g, dim=1)).all()  # |q - z| <= 15
            expected = x @ w16.t() + b
            torch.testing.assert_close(kern.int4_linear(x, packed, ss, g, b), expected, atol=1e-4, rtol=1e-4)


def test_greedy_argmax_is_the_first_maximum():
    """The fused step's greedy choice (vectorized, 16 lanes) is torch.argmax's: ties go to the first position,
    in the vector part and the tail alike; NaNs are skipped."""
    kern = cpu_kernels.kernels()
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 16, 17, 33, 1000, 151936):
        for _ in range(20):
            x = torch.randint(-3, 4, (n,), generator=g).float()  # few distinct values: many ties
            assert kern.argmax_first(x) == int(x.argmax())
        x = torch.full((n,), -5.0)
        x[n - 1] = 2.0  # the maximum in the tail (or the last lane)
        assert kern.argmax_first(x) == n - 1
        x = torch.randn(n, generator=g)
        nans = torch.randint(0, n, (3,), generator=g)
        x[nans] = float("nan")
        assert kern.argmax_first(x) == int(torch.where(x.isnan(), -float("inf"), x).argmax())
    assert kern.argmax_first(torch.full((40,), -float("inf"))) == 0


def test_phase_timing_accounts_each_fused_step(checkpoint_factory):
    """The fused step's phase timers (scripts/profile_step.py): off, nothing is timed; on, every step is, in every
    phase, within the wall time of the generate; phase_bytes names the bytes each linear phase reads a step."""
    llm = LLM(checkpoint_factory("qwen3"), dtype="float32")
    dec = llm.engine.runner.fused.dec
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(PROMPTS[:1], params)
    assert dict(dec.phase_times())["steps"] == 0
    dec.set_phase_timing(True)
    steps_before = llm.engine.runner.fused_steps
    t0 = time.perf_counter()
    llm.generate(PROMPTS[:1], params)
    wall = time.perf_counter() - t0
    dec.set_phase_timing(False)
    times = dict(dec.phase_times())
    assert list(times) == ["norms", "qkv", "rope", "attention", "o", "gate_up", "act", "down", "head", "steps"]
    assert times.pop("steps") == llm.engine.runner.fused_steps - steps_before > 0
    assert all(v > 0 for v in times.values()) and sum(times.values()) < wall
    assert dict(dec.phase_times())["steps"] == 0  # read and started again
    model = llm.engine.runner.model
    weights = {name: sum(getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name).weight.nbytes
                         for layer in model.model.layers) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    nbytes = dict(dec.phase_bytes())
    assert nbytes == {"qkv": weights["qkv_proj"], "o": weights["o_proj"], "gate_up": weights["gate_up_proj"],
                      "down": weights["down_proj"], "head": model.lm_head.weight.nbytes}
