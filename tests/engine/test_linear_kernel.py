"""The AVX-512 BF16 decode linear agrees with aten's bf16 linear: same fp32 accumulation, one rounding."""

import pytest
import torch
import torch.nn.functional as F

from leverlab.layers import bf16_linear
from leverlab.layers.linear import Linear

needs_kernel = pytest.mark.skipif(not bf16_linear.available(), reason="no AVX-512 BF16 kernel on this machine")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 32])
@pytest.mark.parametrize("n,k", [(37, 100), (64, 1024), (203, 96), (9, 31)])  # K and N tails included
def test_kernel_matches_aten(rows, n, k):
    if rows > bf16_linear.cpu_kernels.kernels().skinny_max_rows():
        pytest.skip("past the rows this build's kernel takes (32)")
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    exact = F.linear(x.float(), w.float(), b.float())
    ours = bf16_linear.cpu_kernels.kernels().skinny_linear(x, w, b).float()
    aten = F.linear(x, w, b).float()
    # Both accumulate in fp32 and round once to bf16: each is within half a bf16 ulp of the exact product
    # (plus summation-order noise), so they differ by at most one ulp.
    ulp = exact.abs().clamp_min(1e-3) * 2**-7
    assert ((ours - exact).abs() <= ulp).all()
    assert ((ours - aten).abs() <= ulp).all()


@needs_kernel
def test_every_prefetch_mode_computes_the_same():
    """The prefetch mode is a template argument of the kernel (one instantiation per mode, picked per call):
    each must give the same bits, at one row (where the mode applies) and at several."""
    kern = bf16_linear.cpu_kernels.kernels()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(203, 1000, generator=g).bfloat16()
    held = kern.stream_prefetch()
    try:
        for rows in (1, 3, 16):
            x = torch.randn(rows, 1000, generator=g).bfloat16()
            outs = []
            for mode in ("nta", "t0", "off", "l2"):
                kern.set_stream_prefetch(mode)
                outs.append(kern.skinny_linear(x, w, None))
            assert all(torch.equal(outs[0], o) for o in outs[1:])
    finally:
        kern.set_stream_prefetch(held)


@needs_kernel
def test_linear_layer_uses_it_eager_and_compiled():
    layer = Linear(96, 40, bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    compiled = torch.compile(layer, dynamic=True)
    for rows in (1, 3, 12, 1):  # 12 rows: the op hands them to aten
        x = torch.randn(rows, 96).bfloat16()
        ref = F.linear(x, layer.weight, layer.bias)
        with torch.inference_mode():
            eager, comp = layer(x), compiled(x)
        assert torch.allclose(eager.float(), ref.float(), atol=0.05, rtol=0.01)
        assert torch.equal(eager, comp)


def test_float32_and_autograd_keep_aten():
    layer = Linear(8, 4)
    assert not bf16_linear.wanted(torch.randn(1, 8), layer.weight)
    w = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not bf16_linear.wanted(torch.randn(1, 8, dtype=torch.bfloat16), w)


def test_prefetch_is_measured_at_load_and_off_by_env(checkpoint_factory, monkeypatch, request):
    """The loader times a pass over each kernel family's linear layers in each weight-prefetch mode and keeps the
    family's fastest (layers/prefetch_tune.py); LEVERLAB_STREAM_PREFETCH sets one for every family without
    measuring, LEVERLAB_NO_STREAM_PREFETCH=1 turns it off, and an unknown mode or family is refused."""
    from leverlab.layers import prefetch_tune
    from leverlab.models.loader import load_model

    kern = bf16_linear.cpu_kernels.kernels()
    if kern is None:
        pytest.skip("no C++ kernels here")
    monkeypatch.setattr(prefetch_tune, "_largest_tuned", 0)  # before the load: larger models loaded by other tests
    if kern.amx_bf16_enabled():  # bf16 rows on AMX tiles prefetch nothing (test_amx_bf16.py): stream them here
        kern.set_amx_bf16(False)
        request.addfinalizer(lambda: kern.set_amx_bf16(True))
    model = load_model(checkpoint_factory("qwen3"), "bfloat16")
    choice = prefetch_tune.tune(model)
    assert list(choice) == ["bf16"] and choice["bf16"] in ("nta", "t0", "off")
    assert kern.stream_prefetch() == choice["bf16"]
    # a smaller model loaded after it (a speculative draft) keeps the mode the larger one measured
    kern.set_stream_prefetch("off" if choice["bf16"] != "off" else "t0")
    held = kern.stream_prefetch()
    draft = load_model(checkpoint_factory("qwen3", num_hidden_layers=1), "bfloat16")
    assert prefetch_tune.tune(draft) is None and kern.stream_prefetch() == held
    monkeypatch.setenv("LEVERLAB_STREAM_PREFETCH", "t0")
    assert prefetch_tune.tune(model) == {"bf16": "t0"}
    assert [kern.stream_prefetch(f) for f in ("bf16", "int8", "int4", "int6")] == ["t0"] * 4
    assert model.prefetch_tuned["bf16"] in ("nta", "t0", "off")  # measured at its load: warm-up checks it by steps
    assert load_model(checkpoint_factory("qwen3"), "bfloat16").prefetch_tuned is None  # forced: nothing to check
    monkeypatch.setenv("LEVERLAB_STREAM_PREFETCH", "l2")  # not timed at load, but can be asked for
    assert prefetch_tune.tune(model) == {"bf16": "l2"} and kern.stream_prefetch("int4") == "l2"
    monkeypatch.setenv("LEVERLAB_STREAM_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match="LEVERLAB_STREAM_PREFETCH"):
        prefetch_tune.tune(model)
    monkeypatch.setenv("LEVERLAB_NO_STREAM_PREFETCH", "1")
    assert prefetch_tune.tune(model) == {"bf16": "off"} and kern.stream_prefetch() == "off"
    kern.set_stream_prefetch("nta")  # the default, for the tests that follow
    with pytest.raises(RuntimeError, match="'off', 'nta', 't0' or 'l2'"):
        kern.set_stream_prefetch("on")
    with pytest.raises(RuntimeError, match="family 'bf16', 'int8', 'int4', 'int6' or 'all'"):
        kern.set_stream_prefetch("off", "int2")


@needs_kernel
def test_each_kernel_family_has_its_own_prefetch_mode(checkpoint_factory, monkeypatch):
    """An int4 model streams its body through the int4 kernel and its head (int8 by default) through the int8
    one: the loader measures and sets a mode for each family, and setting one family's leaves the others."""
    from leverlab.layers import prefetch_tune
    from leverlab.models.loader import load_model

    kern = bf16_linear.cpu_kernels.kernels()
    model = load_model(checkpoint_factory("qwen3"), "bfloat16", quantization="int4")
    monkeypatch.setattr(prefetch_tune, "_largest_tuned", 0)
    try:
        choice = prefetch_tune.tune(model)
        assert sorted(choice) == ["int4", "int8"] and set(choice.values()) <= {"nta", "t0", "off"}
        assert all(kern.stream_prefetch(f) == m for f, m in choice.items())
        kern.set_stream_prefetch("nta")
        kern.set_stream_prefetch("t0", "int8")
        assert [kern.stream_prefetch(f) for f in ("bf16", "int8", "int4")] == ["nta", "t0", "nta"]
    finally:
        kern.set_stream_prefetch("nta")


def test_prefetch_choice_needs_a_win_in_every_round():
    """The tuner keeps the default (nta) unless another mode beat it by the margin in every round: one lucky pass
    (a spell of the machine's bandwidth) does not move a model off the mode that protects the step's other data."""
    from leverlab.layers.prefetch_tune import DEFAULT, MARGIN, choose

    assert DEFAULT == "nta" and MARGIN == 0.05
    assert choose({"nta": [10.0, 10.0, 10.0], "off": [8.0, 10.5, 9.0], "t0": [10.0, 10.0, 10.0], "l2": [9.9] * 3}) \
        == "nta"  # off won two rounds of three; l2 by less than the margin
    assert choose({"nta": [10.0, 12.0, 10.0], "off": [9.0, 11.0, 9.4], "t0": [8.0, 11.6, 9.0], "l2": [10.0] * 3}) \
        == "off"  # t0 was fastest in two rounds but within the margin in the second (11.6 > 0.95 * 12)
    # whole steps (tune_steps): the passes' choice is the default, and 4 wins of 5 rounds are enough
    five = {"measured": [10.0] * 5, "off": [9.0, 9.0, 11.0, 9.0, 9.0], "t0": [9.0, 11.0, 9.0, 11.0, 9.0]}
    assert choose(five, default="measured", margin=0.03, wins_needed=4) == "off"
    assert choose(five, default="measured", margin=0.03) == "measured"
    # two steady winners: the faster by its best pass
    assert choose({"nta": [10.0, 10.0], "off": [9.0, 9.4], "t0": [8.0, 9.0], "l2": [10.0, 10.0]}) == "t0"


@needs_kernel
def test_whole_decode_steps_overrule_the_passes_choice_only_by_a_steady_win(monkeypatch):
    """tune_steps times candidates through whole decode steps (the passes' choice, then every family in one kind,
    l2 included) and keeps the passes' choice unless another beat it by STEP_MARGIN in STEP_WINS of STEP_ROUNDS
    rounds. Here a step's time follows the kind the kernels are really set to, as a stand-in decode step whose
    cost is known exactly."""
    from leverlab.layers import prefetch_tune

    kern = bf16_linear.cpu_kernels.kernels()
    clock = [0.0]
    monkeypatch.setattr(prefetch_tune.time, "perf_counter", lambda: clock[0])

    def step_costing(cost: dict[str, float], jitter: dict[int, float] | None = None):
        calls = [0]

        def step():  # the call's cost in the int4 family's kind, times a jitter for some calls (numbered from 1)
            calls[0] += 1
            clock[0] += cost[kern.stream_prefetch("int4")] * (jitter or {}).get(calls[0], 1.0)
        return step

    try:
        measured = {"int4": "nta", "int6": "t0"}
        # off steadily 20% faster than the passes' choice (int4 nta here), l2 10%: off kept, for every family
        assert prefetch_tune.tune_steps(step_costing({"nta": 1.0, "t0": 1.0, "off": 0.8, "l2": 0.9}), measured) == \
            {"int4": "off", "int6": "off"}
        assert [kern.stream_prefetch(f) for f in ("int4", "int6")] == ["off", "off"]
        # l2, which the passes never time, is a whole-step candidate too
        assert prefetch_tune.tune_steps(step_costing({"nta": 1.0, "t0": 1.0, "off": 0.9, "l2": 0.8}), measured) == \
            {"int4": "l2", "int6": "l2"}
        # within the margin: the passes' choice stays, family by family
        assert prefetch_tune.tune_steps(step_costing({"nta": 1.0, "t0": 0.99, "off": 0.98, "l2": 0.98}),
                                        measured) == measured
        assert [kern.stream_prefetch(f) for f in ("int4", "int6")] == ["nta", "t0"]
        # faster in one round only (every other step of the measured choice slowed in round 1): kept as measured
        slow_first_round = {i: 1.5 for i in range(1, 5)}
        assert prefetch_tune.tune_steps(step_costing({"nta": 1.0, "t0": 1.0, "off": 1.0, "l2": 1.0}, slow_first_round),
                                        measured) == measured

        def failing():
            raise RuntimeError("no step")
        assert prefetch_tune.tune_steps(failing, measured) == measured  # a failed timing keeps the passes' choice
    finally:
        kern.set_stream_prefetch("nta")
