"""Each method's matmul against the weight it claims to hold, and that weight against the original."""

import pytest
import torch

from leverlab.errors import UnsupportedLever
from leverlab.layers.linear import Linear, packed
from leverlab.models.loader import attach_quant_method, finish_quantization
from leverlab.quant.registry import get_quant_method
from leverlab.quant_config import QUANT_METHODS

LOAD_TIME = ("int8", "int8-woq", "int4", "int4-g32", "int4-g64", "int4-g128", "int6", "fp8")


def quantized_linear(name: str, dtype=torch.float32, in_f=256, bias=True, seed=0):
    torch.manual_seed(seed)
    rows, shards = packed({"q": 64, "k": 32, "v": 32})
    with torch.device("cpu"):
        layer = Linear(in_f, rows, bias=bias, shards=shards).to(dtype)
    w = torch.randn(rows, in_f) * 0.05
    w[3, 17] = 0.9  # an outlier: per-channel/group scales must still hold the rest of the row
    b = torch.randn(rows) * 0.1
    method = get_quant_method(name)
    holder = torch.nn.Module()
    holder.layer = layer
    (attached,) = attach_quant_method(holder, method)
    for shard, (off, size) in shards.items():
        layer.load("weight", w[off:off + size].to(dtype), shard)
        if bias:
            layer.load("bias", b[off:off + size].to(dtype), shard)
    finish_quantization([attached])
    return layer, w, b


@pytest.mark.parametrize("name", LOAD_TIME)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_agrees_with_dequantized_reference(name, dtype):
    layer, w, b = quantized_linear(name, dtype)
    assert layer.weight is None, "the float weight must be freed once quantized"
    ref_w = layer.quant_method.dequantize(layer)
    x = torch.randn(2, 5, 256).to(dtype)  # 3-D input, as prefill chunks arrive
    y = layer(x)
    assert y.shape == (2, 5, 128) and y.dtype == dtype
    expected = x.float() @ ref_w.t() + b.to(dtype).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * expected.abs().max().item()
    assert (y.float() - expected).abs().max().item() < tol
    for m in (1, 16):  # decode rows: one sequence and a batch
        x2 = torch.randn(m, 256).to(dtype)
        assert (layer(x2).float() - (x2.float() @ ref_w.t() + b.to(dtype).float())).abs().max().item() < max(
            tol, 3e-2 * x2.abs().max().item() if dtype == torch.bfloat16 else tol)


@pytest.mark.parametrize("name", LOAD_TIME)
def test_dequantized_weight_is_close_to_the_original(name):
    layer, w, _ = quantized_linear(name)
    err = (layer.quant_method.dequantize(layer) - w).abs()
    if name.startswith("int8"):  # round-to-nearest: at most half a step of the row's scale
        bound = (w.abs().amax(1) / 127 / 2)[:, None]
    elif name.startswith(("int4", "int6")):
        g, levels = layer.quant_method.group_size, 15 if name.startswith("int4") else 63
        wg = w.reshape(w.shape[0], -1, g)
        bound = ((wg.amax(-1) - wg.amin(-1)) / levels).repeat_interleave(g, 1)  # within one step (rounded zero)
    else:  # fp8 e4m3: 3 mantissa bits, relative error <= 2^-4, plus the subnormal floor
        bound = w.abs() * 2**-4 + (w.abs().amax(1) / 448 * 2**-9)[:, None]
    assert (err <= bound * 1.001 + 1e-6).all(), (err - bound).max()


def test_int4_kernel_holds_exactly_the_rtn_weight():
    """RTN's q and z, and its scales rounded once to fp16 (as the kernel stores them)."""
    from leverlab.quant.layouts import dequantize_int4, quantize_int4

    layer, w, _ = quantized_linear("int4-g32")
    q, s, z = quantize_int4(w, 32)
    assert torch.equal(layer.quant_method.dequantize(layer), dequantize_int4(q, s.half().float(), z, 32))


def test_registry_names_the_valid_choices():
    from leverlab.config import EngineConfig

    with pytest.raises(UnsupportedLever, match="valid: none, int8, int8-woq, int4"):
        EngineConfig(quantization="int3")
    with pytest.raises(UnsupportedLever, match="valid: auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int2")
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(quantization="int4-g32", kv_cache_dtype="int8").quantization == "int4-g32"
    with pytest.raises(UnsupportedLever, match="pre-quantized AWQ"):
        get_quant_method("awq")
    assert set(LOAD_TIME) | {"awq", "gptq", "compressed-tensors", "int8+head", "int4+head"} == set(QUANT_METHODS)
    with pytest.raises(UnsupportedLever, match="pre-quantized COMPRESSED-TENSORS checkpoints only"):
        get_quant_method("compressed-tensors")
    with pytest.raises(UnsupportedLever, match="valid: auto, none, int8, int6, same"):
        EngineConfig(lm_head_quantization="int4")
    assert get_quant_method("int4+head").quantize_lm_head and not get_quant_method("int4").quantize_lm_head


def test_int4_refuses_a_group_that_does_not_divide_the_layer():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantized_linear("int4-g128", in_f=192)


def test_int6_refuses_rows_that_are_not_whole_quads():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantized_linear("int6", in_f=192)


def test_int6_layout_puts_each_weights_high_bits_where_the_kernel_reads_them():
    """pack_int6_streaming: per 128-weight quad, 96 bytes: its low nibbles in int4's layout, then 32 bytes whose
    byte t holds the high 2 bits of the kernel's low-vector lanes t, 32 + t and high-vector lanes t, 32 + t (lane
    16 j + i: weight 32 j + i, or 32 j + 16 + i). Checked weight by weight against that rule, and unpacked back
    exactly."""
    from leverlab.quant.layouts import pack_int4_streaming, pack_int6_streaming, unpack_int6_streaming

    torch.manual_seed(1)
    q = torch.randint(0, 64, (3, 256), dtype=torch.uint8)
    s, z = torch.rand(3, 4) + 0.1, torch.randint(0, 64, (3, 4), dtype=torch.uint8)
    packed, ss = pack_int6_streaming(q, s, z, 64)
    assert packed.shape == (3, 192) and ss.shape == (3, 2, 4)
    nib, ss4 = pack_int4_streaming(q & 15, s, z, 64)
    quads = packed.view(3, 2, 96)
    assert torch.equal(quads[:, :, :64].reshape(3, 128), nib) and torch.equal(ss, ss4)
    for k in range(256):
        quad, j, i = k // 128, (k % 128) // 32, k % 32
        lane = 16 * j + i % 16
        shift = (0 if i < 16 else 4) + (0 if lane < 32 else 2)
        high = (quads[:, quad, 64 + lane % 32].int() >> shift) & 3
        assert torch.equal(high, (q[:, k] >> 4).int()), k
    assert torch.equal(unpack_int6_streaming(packed), q)


def test_int8_gemm_quantizes_activations_per_row():
    from leverlab.quant import int8_gemm

    layer, w, b = quantized_linear("int8", torch.bfloat16)
    # 8-bit activations: ~1/255 of a row's scale; 7-bit where the CPU lacks VNNI (int8_gemm.REDUCE_RANGE): ~1/127
    bound = 4e-2 if int8_gemm.REDUCE_RANGE else 2e-2
    assert layer.kernel_state.int8_key is not None and layer.qweight is None  # one packed copy serves every batch size
    ref_w = layer.quant_method.dequantize(layer)
    for m in (1, 16, 100):
        x = torch.randn(m, 256).to(torch.bfloat16)
        x[m // 2] *= 1000  # a loud row (a prefill token with massive activations) must not coarsen the others
        expected = x.float() @ ref_w.t() + b.to(torch.bfloat16).float()
        err = (layer(x).float() - expected).abs().amax(1) / expected.abs().amax(1)
        assert err.max() < bound, err.max()  # each row within a step of its own scale (plus bf16 output)


@pytest.mark.parametrize("name", ("int8", "int8-woq"))
def test_int8_few_rows_take_the_streaming_kernel(name):
    """Up to 16 rows: our streaming kernel where the C++ kernels are built, with the activations quantized per
    32-block for integer dot products (int8) or left as they are (int8-woq, weight-only by request); without
    the kernels, aten's weight-only kernel (int8-woq)."""
    from leverlab.kernels import cpu_kernels

    layer, w, b = quantized_linear(name, torch.bfloat16)
    x = torch.randn(16, 256).to(torch.bfloat16)
    if cpu_kernels.kernels() is not None:
        quantize_x = name == "int8"
        assert layer.quant_method.quantize_activations == quantize_x
        assert torch.equal(layer(x), cpu_kernels.kernels().int8_linear(x, *layer.kernel_state.stream, layer.bias, quantize_x))
    elif name == "int8-woq":
        assert layer.qweight is not None and layer.kernel_state.int8_key is not None
        expected = torch.ops.aten._weight_int8pack_mm(x[:1], layer.qweight, layer.scales) + b.to(torch.bfloat16)
        assert torch.equal(layer(x[:1]), expected)


def test_int4_batched_path_uses_an_int8_copy_of_the_int4_weight():
    from leverlab.quant import int8_gemm
    from leverlab.quant.base import STREAMING_MAX_ROWS

    layer, w, b = quantized_linear("int4-g32", torch.bfloat16)
    if layer.kernel_state.stream is not None:  # streaming up to 16 rows, the int8 copy past that: aten's int4 layout is not kept
        assert layer.qweight is None and layer.scales_and_zeros is None
    w4 = layer.quant_method.dequantize(layer)
    q8, s8 = int8_gemm.unpack(layer.kernel_state.int8_key)
    # the copy re-quantizes the int4 weight: within half an int8 step per channel (+ the bf16 rounding of w4,
    # which the kernel's bf16 scales and zeros carry and the copy, made in float32, does not)
    copy = q8.float() * s8[:, None]
    bound = w4.abs().amax(1, keepdim=True) * (1 / 254 + 2**-7)
    assert ((copy - w4).abs() <= bound * 1.001 + 1e-7).all()
    rows = STREAMING_MAX_ROWS + 1  # past the streaming kernel
    x = torch.randn(rows, 256).to(torch.bfloat16)
    expected = x.float() @ copy.t() + b.to(torch.bfloat16).float()
    bound = 4e-2 if int8_gemm.REDUCE_RANGE else 2e-2  # 7-bit activations without VNNI (see int8_gemm.py)
    assert ((layer(x).float() - expected).abs() <= bound * expected.abs().amax(1, keepdim=True)).all()
    assert layer.quant_method.bytes_read(layer, 1) < layer.quant_method.bytes_read(layer, rows)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_autotune_times_both_kernels_and_either_gives_the_weight(name, monkeypatch):
    """Load-time tuning (quant/autotune.py): each layer streams up to the rows where that is measured no slower
    than fbgemm's GEMM over the int8 copy; whichever kernel a row count takes, the product is the layer's weight's.
    LEVERLAB_STREAM_ROWS fixes the cut instead."""
    from leverlab.quant import autotune

    layer, w, b = quantized_linear(name, torch.bfloat16)
    if not autotune.eligible(layer):
        pytest.skip("no streaming kernel or no fbgemm here: nothing to choose between")
    autotune.tune([layer])
    assert 0 <= layer.kernel_state.stream_rows <= 16 and sorted(layer.kernel_state.row_times) == list(autotune.ROWS)
    assert all(t > 0 for pair in layer.kernel_state.row_times.values() for t in pair)
    ref_w = layer.quant_method.dequantize(layer)
    x = torch.randn(16, 256).to(torch.bfloat16)
    expected = x.float() @ ref_w.t() + b.to(torch.bfloat16).float()
    for rows in (0, 16):  # everything on fbgemm's GEMM (past one row), everything streamed
        layer.kernel_state.stream_rows = rows
        assert ((layer(x).float() - expected).abs() <= 5e-2 * expected.abs().amax(1, keepdim=True)).all()
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "2")
    autotune.tune([layer])
    assert layer.kernel_state.stream_rows == 2 and autotune.fused_rows([layer], 1) == 2



def _rows_agree_with_the_single_stream(linear, w: torch.Tensor, k: int) -> None:
    """linear(x) over 2..16 bf16 rows equals linear() of each row alone to one bf16 step, and one row's result
    is x times the dequantized weight w to within the activations' quantization."""
    for m in (2, 3, 4, 5, 8, 13, 16):
        x = torch.randn(m, k).to(torch.bfloat16)
        y = linear(x).float()
        one = torch.cat([linear(x[i : i + 1]) for i in range(m)]).float()
        assert ((y - one).abs() <= one.abs() * 2**-7 + 1e-6).all(), (m, (y - one).abs().max().item())
        ref = x.float() @ w.T
        assert (one - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("k,g", [(256, 64), (384, 64), (352, 32), (1024, 128), (512, 32), (608, 32)])
def test_int4_streaming_kernel_paths_agree(k, g):
    """Every row count the streaming int4 kernel takes (1..16: the single stream, the AVX2 pairs, the AVX-512
    quads; the AVX-512 single stream's rows reduced 16 together), block counts odd, even and not a multiple of 4,
    an odd number of weight rows: each output row equals the single stream's for that row alone (the same quantized
    arithmetic, summed in another order: at most one bf16 step apart), and the single stream is the dequantized
    weight's product to within the activations' quantization."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import dequantize_streaming, pack_int4_streaming, quantize_int4

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k + g)
    packed, ss = pack_int4_streaming(*quantize_int4(torch.randn(73, k) * 0.05, g), g)
    _rows_agree_with_the_single_stream(lambda x: kern.int4_linear(x, packed, ss, g, None),
                                       dequantize_streaming(packed, ss), k)


@pytest.mark.parametrize("k", [256, 768, 1024])
def test_int4_interleaved_rows_are_the_row_layout_in_another_order(k):
    """pack_int4_interleaved (each row's groups of 64 interleaved four at a time, for AVX2's kernel) holds the same
    weight as the row layout: it unpacks to it byte for byte, in Python and in C++; with bf16 activations its
    kernel (AVX2 without AVX-512 VNNI) gives every row count 1..16 the row layout's results to one bf16 step;
    float32 activations and rows past the streaming kernel take the row layout's paths exactly
    (_interleaved_agree_with_rows). Malformed weights get a clear error."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import (
        dequantize_streaming,
        interleaved_to_rows,
        pack_int4_interleaved,
        pack_int4_streaming,
        quantize_int4,
    )

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k)
    q, s, z = quantize_int4(torch.randn(40, k) * 0.05, 64)
    packed, ss = pack_int4_streaming(q, s, z, 64)
    il = pack_int4_interleaved(q)
    assert il.shape == (40, k // 256, 128) and il.numel() == packed.numel()
    assert torch.equal(interleaved_to_rows(il), packed)
    assert torch.equal(kern.int4_interleaved_to_rows(il), packed)
    assert torch.equal(dequantize_streaming(il, ss), dequantize_streaming(packed, ss))
    # one weight per position: the first channel of each group sits in the low nibble of byte 4 g of the step
    assert torch.equal(il[:, 0, torch.arange(4) * 4] & 15, q[:, torch.arange(4) * 64].to(torch.uint8))
    b = torch.randn(40)
    x = _interleaved_agree_with_rows(lambda x, w: kern.int4_linear(x, w, ss, 64, b), il, packed, k,
                                     (1, 2, 3, 4, 5, 8, 16, 17), kern.has_int4_interleaved())
    with pytest.raises(RuntimeError, match="interleaved rows"):
        kern.int4_linear(x, il, ss, 32, b)
    with pytest.raises(RuntimeError, match="interleaved rows"):
        kern.int4_linear(x[:, :-256].contiguous(), il, ss, 64, b)


def _interleaved_agree_with_rows(linear, il, rows, k: int, ms, streams: bool) -> torch.Tensor:
    """linear(x, weight) over bf16 rows: with `streams` (AVX2 without AVX-512 VNNI) and up to 16 rows, the
    interleaved rows give the row layout's results to one bf16 step (the same integer sums, split across other
    lanes before their scales apply); else (17 rows, other CPUs) the row layout's exactly; float32 rows the row
    layout's exactly. Returns the last x."""
    for m in ms:
        x = torch.randn(m, k).to(torch.bfloat16)
        y, ref = linear(x, il).float(), linear(x, rows).float()
        if streams and m <= 16:
            assert ((y - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all(), (m, (y - ref).abs().max().item())
        else:
            assert torch.equal(y, ref), m
        assert torch.equal(linear(x.float(), il), linear(x.float(), rows))
    return x


def _panels_agree_with_rows(linear, panels, rows, k: int, ms, streams: bool) -> torch.Tensor:
    """linear(x, weight) over bf16 rows: with `streams` (AVX-512 VNNI) and up to 16 rows, the panels give the row
    layout's results to one bf16 step and each output row bit for bit what that row alone gives; else (17 rows,
    no VNNI) the row layout's exactly; float32 rows the row layout's exactly. Returns the last x."""
    for m in ms:
        x = torch.randn(m, k).to(torch.bfloat16)
        y, ref = linear(x, panels).float(), linear(x, rows).float()
        if streams and m <= 16:
            assert ((y - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all(), (m, (y - ref).abs().max().item())
            one = torch.cat([linear(x[i : i + 1], panels) for i in range(m)]).float()
            assert torch.equal(y, one), m
        else:
            assert torch.equal(y, ref), m
        assert torch.equal(linear(x.float(), panels), linear(x.float(), rows))
    return x


@pytest.mark.parametrize("k,g", [(256, 64), (352, 32), (1024, 128), (512, 256), (1536, 64)])
def test_int4_panels_are_the_row_layout_in_another_order(k, g):
    """pack_int4_panels (16 weight rows interleaved per group, their scales in the stream) holds the same weight
    as the row layout: it unpacks to it byte for byte; with bf16 activations its kernel (AVX-512 VNNI) gives
    every row count 1..17 the row layout's results to one bf16 step, and each output row bit for bit what that
    row alone gives (integer sums per group, one float order whatever the batch); float32 activations and rows
    past the streaming kernel take the row layout's paths exactly."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import (
        dequantize_streaming,
        pack_int4_panels,
        pack_int4_streaming,
        panels_to_rows,
        quantize_int4,
    )

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k + g)
    q, s, z = quantize_int4(torch.randn(48, k) * 0.05, g)
    packed, ss = pack_int4_streaming(q, s, z, g)
    panels = pack_int4_panels(q, s, z, g)
    assert panels.shape == (3, k // g, 8 * g + 64) and panels.numel() == packed.numel() + 2 * ss.numel()
    assert torch.equal(panels_to_rows(panels, g), packed)
    assert torch.equal(dequantize_streaming(panels, ss), dequantize_streaming(packed, ss))
    b = torch.randn(48)
    x = _panels_agree_with_rows(lambda x, w: kern.int4_linear(x, w, ss, g, b), panels, packed, k,
                                (1, 2, 3, 4, 5, 8, 9, 16, 17), kern.has_fast_int6())
    with pytest.raises(RuntimeError, match="panels"):
        kern.int4_linear(x, panels[:, :, :-1].contiguous(), ss, g, b)


@pytest.mark.parametrize("k,g", [(128, 32), (384, 64), (1024, 128), (512, 256)])
def test_int6_panels_are_the_row_layout_in_another_order(k, g):
    """pack_int6_panels (int4's panels, each vector followed by its weights' high 2 bits) holds the same weight as
    the int6 rows: both unpack to the same q; bf16 rows 1..16 through its kernel (AVX-512 VNNI) give the rows'
    results to one bf16 step and each output row bit for bit what that row alone gives; float32 activations and
    17 rows take the rows' paths exactly."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import (
        pack_int6_panels,
        pack_int6_streaming,
        quantize_int6,
        unpack_int6_streaming,
    )

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k + g)
    q, s, z = quantize_int6(torch.randn(32, k) * 0.05, g)
    packed, ss = pack_int6_streaming(q, s, z, g)
    panels = pack_int6_panels(q, s, z, g)
    assert panels.shape == (2, k // g, 12 * g + 64) and panels.numel() == packed.numel() + 2 * ss.numel()
    assert torch.equal(unpack_int6_streaming(panels), q) and torch.equal(unpack_int6_streaming(packed), q)
    b = torch.randn(32)
    _panels_agree_with_rows(lambda x, w: kern.int6_linear(x, w, ss, g, b), panels, packed, k,
                            (1, 2, 3, 8, 9, 16, 17), kern.has_fast_int6())


def test_int8_panels_are_the_row_layout_in_another_order():
    """pack_int8_panels (16 weight rows interleaved per 32-channel block, stored as q + 128) holds the same weight:
    it unpacks to it exactly; with bf16/fp16 activations quantized (AVX-512 VNNI) every row count 1..16 gives
    the row layout's results to one output step, each output row bit for bit what that row alone gives; the
    other paths (weight-only, float32, more rows than stream) are the row layout's, exactly."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import int8_panels_to_rows, pack_int8_panels

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(0)
    for n, k in ((16, 32), (48, 1056), (32, 2048)):
        w, s, b = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100, torch.randn(n)
        panels = pack_int8_panels(w)
        assert panels.shape == (n // 16, k // 32, 512) and torch.equal(int8_panels_to_rows(panels), w)
        for m in (1, 2, 3, 5, 8, 9, 16, 17):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = (torch.randn(m, k) * 2).to(dtype)
                for quantize_x in (True, False):
                    y = kern.int8_linear(x, panels, s, b, quantize_x).float()
                    rows = kern.int8_linear(x, w, s, b, quantize_x).float()
                    streamed = quantize_x and dtype != torch.float32 and m <= 16 and kern.has_fast_int6()
                    if not streamed:
                        assert torch.equal(y, rows), (n, k, m, dtype, quantize_x)
                        continue
                    assert ((y - rows).abs() <= rows.abs() * 2**-7 + 1e-3).all(), (m, (y - rows).abs().max().item())
                    one = torch.cat([kern.int8_linear(x[i : i + 1], panels, s, b, True) for i in range(m)]).float()
                    assert torch.equal(y, one), (n, k, m, dtype)
    with pytest.raises(RuntimeError, match="panels"):
        kern.int8_linear(x, panels[:, :, :-1].contiguous(), s, b, True)


def test_quantized_layers_stream_panels_with_avx512_vnni():
    """int8 (activations quantized), int4 and int6 layers whose output rows come in sixteens keep their streaming
    weight as panels where the kernels stream them (AVX-512 VNNI, bf16/fp16 models), else as rows (int4 on AVX2,
    layers whole 256-channel steps wide: interleaved rows); weight-only int8 and float32 models keep rows. Their
    outputs are the dequantized weight's product either way."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import is_interleaved

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no streaming kernels here")
    layer8, w, b = quantized_linear("int8", torch.bfloat16)
    woq, _, _ = quantized_linear("int8-woq", torch.bfloat16)
    assert layer8.kernel_state.stream[0].dim() == (3 if kern.has_fast_int6() else 2) and woq.kernel_state.stream[0].dim() == 2  # (weight-only: rows)
    x = torch.randn(3, layer8.in_features).to(torch.bfloat16)
    expected = x.float() @ layer8.quant_method.dequantize(layer8).t() + b.to(torch.bfloat16).float()
    layer8.kernel_state.stream_rows = 16
    assert ((layer8(x).float() - expected).abs() <= 3e-2 * expected.abs().amax(1, keepdim=True)).all()
    layer6, _, _ = quantized_linear("int6", torch.bfloat16)
    assert layer6.kernel_state.stream[0].dim() == (3 if kern.has_fast_int6() or kern.has_int4_interleaved() else 2)
    f32, _, _ = quantized_linear("int4", torch.float32)
    assert f32.kernel_state.stream[0].dim() == 2  # float32 activations never take the panels' integer path: rows
    layer, w, b = quantized_linear("int4", torch.bfloat16)
    panels = kern.has_fast_int6() and layer.out_features % 16 == 0
    interleaved = not panels and kern.has_int4_interleaved() and layer.in_features % 256 == 0  # (AVX2, groups of 64)
    assert layer.kernel_state.stream[0].dim() == (3 if panels or interleaved else 2) and is_interleaved(layer.kernel_state.stream[0]) == interleaved
    w4 = layer.quant_method.dequantize(layer)
    x = torch.randn(3, layer.in_features).to(torch.bfloat16)
    expected = x.float() @ w4.t() + b.to(torch.bfloat16).float()
    layer.kernel_state.stream_rows = 16
    assert ((layer(x).float() - expected).abs() <= 3e-2 * expected.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("k,g", [(256, 64), (384, 64), (1024, 128), (512, 32), (1024, 256)])
def test_int6_streaming_kernel_paths_agree(k, g):
    """As the int4 test above, for int6 (quant/int6.py): with AVX-512 VNNI the single stream and the quad tiles
    (every row count from 2), elsewhere the plain float loop; float32 rows are the dequantized weight's product."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import dequantize_int6_streaming, pack_int6_streaming, quantize_int6

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k + g)
    packed, ss = pack_int6_streaming(*quantize_int6(torch.randn(73, k) * 0.05, g), g)
    w = dequantize_int6_streaming(packed, ss)
    _rows_agree_with_the_single_stream(lambda x: kern.int6_linear(x, packed, ss, g, None), w, k)
    x = torch.randn(20, k)
    for m in (1, 3, 16, 20):  # float32: exact against the dequantized weight; 20 rows: past the streaming rows
        torch.testing.assert_close(kern.int6_linear(x[:m], packed, ss, g, None), x[:m] @ w.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [256, 768])
def test_int6_interleaved_rows_are_the_row_layout_in_another_order(k):
    """pack_int6_interleaved (int4's interleaved vectors, each pair with its plane of high bits) holds the same
    weight as the row layout: the same q back in Python and, through its own conversion, the same results in C++
    for float32 activations and rows past the streaming kernel, exactly; with bf16 activations its AVX2 single
    stream gives the row layout's results to one bf16 step. Malformed weights get a clear error."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import (
        dequantize_int6_streaming,
        int6_interleaved_to_q,
        pack_int6_interleaved,
        pack_int6_streaming,
        quantize_int6,
    )

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k)
    q, s, z = quantize_int6(torch.randn(40, k) * 0.05, 64)
    rows, ss = pack_int6_streaming(q, s, z, 64)
    il = pack_int6_interleaved(q)
    assert il.shape == (40, k // 256, 192) and il.numel() == rows.numel()
    assert torch.equal(int6_interleaved_to_q(il), q.to(torch.uint8))
    assert torch.equal(dequantize_int6_streaming(il, ss), dequantize_int6_streaming(rows, ss))
    b = torch.randn(40)
    x = _interleaved_agree_with_rows(lambda x, w: kern.int6_linear(x, w, ss, 64, b), il, rows, k,
                                     (1, 2, 3, 16, 17), kern.has_int4_interleaved())
    with pytest.raises(RuntimeError, match="interleaved rows"):
        kern.int6_linear(x, il, ss, 128, b)


def test_int4_models_head_is_int6_where_it_streams_fast(monkeypatch):
    """--lm-head-quantization auto: int6 for int4 in bf16/fp16 on a CPU whose int6 kernel streams (AVX-512 VNNI, AVX2)
    and a hidden size in whole 128-weight quads, else int8; int8 for int8; an explicit int6 whatever the method."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.registry import head_quant_method

    kern = cpu_kernels.kernels()
    fast = kern is not None and kern.has_int6_stream()
    int4, int8 = get_quant_method("int4"), get_quant_method("int8")
    assert head_quant_method(int4, "auto", "cpu", 1024, "bfloat16").name == ("int6" if fast else "int8")
    assert head_quant_method(int4, "auto", "cpu", 384, "float16").name == ("int6" if fast else "int8")
    assert head_quant_method(int4, "auto", "cpu", 1024, "float32").name == "int8"  # the plain loop only
    assert head_quant_method(int4, "auto", "cpu", 64, "bfloat16").name == "int8"  # not whole quads
    assert head_quant_method(int4, "auto", "meta", 1024, "bfloat16").name == "int8"  # no int6 kernel there
    assert head_quant_method(int8, "auto", "cpu", 1024, "bfloat16").name == "int8"
    assert head_quant_method(int8, "int6", "cpu", 1024, "float32").name == "int6"
    assert head_quant_method(None, "auto", "cpu", 1024, "bfloat16") is None
    assert head_quant_method(int4, "int8", "cpu", 1024, "bfloat16").name == "int8"


@pytest.mark.parametrize("k", [256, 352, 384, 608, 1024])
def test_int8_streaming_kernel_paths_agree(k):
    """As the int4 test above, for int8 with quantized activations: the tiles (AVX2, or AVX-512 VNNI where the
    block count is even) agree row by row with the single stream, which is the dequantized weight's product to
    within the activations' quantization."""
    from leverlab.kernels import cpu_kernels
    from leverlab.quant.layouts import quantize_int8

    kern = cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    torch.manual_seed(k)
    q, s = quantize_int8(torch.randn(73, k) * 0.05)
    _rows_agree_with_the_single_stream(lambda x: kern.int8_linear(x, q, s, None, True), q.float() * s[:, None], k)
