"""How the streaming kernels prefetch their weights: measured per model at load (CPU).

The kernels read a decode step's weights as one stream and prefetch ahead of it in one of four ways
(csrc/stream_hint.h), and which is fastest depends on the machine and on whether the model fits in its caches:
  nta  non-temporal, 1 KB ahead (the int4/int6 panels 4 KB: csrc/quant_linear.cpp): keeps the stream from
       evicting the rest of the step's working set; 8-20% faster per step on a Zen 3. The default
       until measured.
  t0   into every cache level, 4 KB ahead: on an Intel Xeon (Sapphire/Emerald Rapids) the quantized kernels had
       waited on memory for every line, arithmetic and memory taking turns; with it one core read int4 weights at
       12.3 GB/s where no prefetch gave 7.6 and nta 8.2, and two threads on the Qwen3-0.6B shape's
       matrices read int4 at 23.0 GB/s (17.0 off, 13.3 nta; torch.sum 26.1).
  off  no software prefetch: on that Xeon, whose L3 is a victim cache, non-temporal lines skip L3, so a model that
       fits there was read from memory again every step with nta (the bundled model, bf16, one thread: 171 tok/s
       with nta, 265-294 without). On a Zen 4 it was the fastest for bf16 and int8 single
       streams of the 0.6B shape (1.13-1.15x and 1.24x nta's tok/s); int4 there kept nta.
  l2   into L2 only (PREFETCHT1), 4 KB ahead: the kind that let decode attention read its cold KV cache at the
       rate of a plain read on a Zen 4 (1.3-1.45x T0's; csrc/paged_decode.cpp). Not timed by the
       passes: there the int4 body's pass preferred it (10.61 ms against nta's 11.55, in each of 3 rounds), but
       whole int4 decodes with it forced ran at 58.7 / 60.8 / 57.5 tok/s against nta's 76.8 / 64.5 / 61.4
       (alternating processes): a pass over the linears alone does not see what the stream evicts. Whole steps
       (`tune_steps`) try it: the bf16 0.6B shape's single stream, in one process with the kinds
       alternating (16 generations each, paired medians), ran 1.04x off's and 1.12x nta's in a slow spell of the
       machine (26 / 25 / 23 tok/s) and 1.06x off's over a mixed one, where int8 ran 0.80x off's and int4 0.96x.
The bf16 kernel follows the mode up to 3 activation rows (it had always prefetched T0 2 KB ahead, which lost to no prefetch on a Zen 4);
from 4 rows on it prefetches into L2 whatever the mode (csrc/skinny_linear.cpp says why).
Each kernel family (bf16, int8, int4, int6) has its own mode, since one model can stream through two: an int4
model's head was int8 (it is int6 now), and on that Zen 4 its int4 body streamed fastest with
nta, its int8 head without a prefetch. So the loader times passes over each family's linear layers at one
activation row, as a decode step reads them, in each mode after a settling pass in that mode, and keeps the
family's fastest (nta unless another beat it by MARGIN in every round: `choose`). Past MAX_BYTES of a family's
weights it times its first layers up to that size: still far beyond any cache, and a pass stays short.
Once the engine can run a decode step, whole steps check that choice (`tune_steps`, from ModelRunner.warmup).
LEVERLAB_STREAM_PREFETCH=off|nta|t0|l2 sets every family's mode without measuring (LEVERLAB_NO_STREAM_PREFETCH=1:
off).
"""

from __future__ import annotations

import logging
import time

import torch

from leverlab import env
from leverlab.kernels import cpu_kernels
from leverlab.layers import bf16_linear
from leverlab.layers.linear import Linear

log = logging.getLogger("leverlab")

MODES = ("nta", "t0", "off")  # the kinds the passes time at load (csrc/stream_hint.h)
STEP_MODES = (*MODES, "l2")  # the kinds whole decode steps try (tune_steps)
FORCEABLE = STEP_MODES
DEFAULT = "nta"
MAX_BYTES = 1 << 30  # the layers timed: a pass over more would be long at load, and no cache keeps them anyway
MARGIN = 0.05  # another mode must be this much faster: the default protects the rest of the step's working set
ROUNDS = 3
SETTLE = 1  # untimed passes after each switch: the first pass pays for the other mode's cache state
TIMED = 2


def _bytes(layer: Linear) -> int:
    m = layer.quant_method
    if m is not None:
        return m.bytes_read(layer, 1)
    return layer.weight.numel() * layer.weight.element_size()


def family(layer: Linear) -> str | None:
    """The kernel family (csrc/stream_hint.h) that streams this layer's weights at one row; None: none of ours, or
    one that issues no software prefetch (bf16 rows on AMX tiles)."""
    m = layer.quant_method
    if m is None:
        return None if bf16_linear.on_tiles(layer.in_features) else "bf16"
    weights = m.fused_weights(layer)  # (kind, tensors): the kernel the layer's decode runs (models/fused.py)
    return None if weights is None else {0: "bf16", 1: "int8", 2: "int4", 3: "int8", 4: "int6"}.get(weights[0])


# The mode is one setting per family for the whole process, and a process can hold two models (a speculative draft
# model beside its target): the larger one's weight stream dominates every step, so a smaller model loaded later
# keeps the modes its elder measured (a draft that fits in L3 would otherwise pick its own mode for the target's
# stream).
_largest_tuned = 0  # weight bytes of the largest model whose measurement set the modes


def tune(model: torch.nn.Module) -> dict[str, str] | None:
    """Set the prefetch mode of each kernel family this model streams through; returns {family: mode} (None: not
    measured, the modes kept)."""
    global _largest_tuned
    kern = cpu_kernels.kernels()
    if kern is None:
        return None
    linears = [(m, _bytes(m)) for m in model.modules() if isinstance(m, Linear)]
    families: dict[str, list[tuple[Linear, int]]] = {}  # family -> its (layer, bytes read at one row)
    model_bytes = sum(b for _, b in linears)
    for m, b in linears:
        if (f := family(m)) is not None:
            families.setdefault(f, []).append((m, b))
    if mode := forced():
        kern.set_stream_prefetch(mode)  # every family
        return dict.fromkeys(families, mode)
    if not families or model_bytes < _largest_tuned:
        return None
    dtype = model.model.embed_tokens.weight.dtype  # the activations' dtype (a quantized layer's weight is not)
    chosen = {}
    for f, layers in families.items():
        chosen[f] = _tune_family(kern, f, layers, dtype)
        if chosen[f] is None:  # the measurement failed (logged): the family keeps the default
            return None
    _largest_tuned = model_bytes
    return chosen


def forced() -> str:
    """The kind LEVERLAB_STREAM_PREFETCH (or LEVERLAB_NO_STREAM_PREFETCH=1: off) sets for every family; "" if none."""
    mode = "off" if env.flag("LEVERLAB_NO_STREAM_PREFETCH") else env.get("LEVERLAB_STREAM_PREFETCH", "")
    if mode and mode not in FORCEABLE:
        raise ValueError(f"LEVERLAB_STREAM_PREFETCH must be one of {', '.join(FORCEABLE)}, not {mode!r}")
    return mode


def _tune_family(kern, fam: str, linears: list[tuple[Linear, int]], dtype: torch.dtype) -> str | None:
    """Time passes over one family's (layer, bytes) (one row each) in every mode; set and return the fastest."""
    layers, total = [], 0
    for m, b in linears:
        if total < MAX_BYTES:
            layers.append(m)
            total += b
    xs = [torch.randn(1, m.in_features, dtype=dtype) for m in layers]

    def one_pass() -> float:
        t = time.perf_counter()
        for m, x in zip(layers, xs):
            Linear.forward(m, x)  # the layer's own kernel; no tensor-parallel collective
        return time.perf_counter() - t

    # Each mode is timed in its own steady state: a pass right after a switch still pays for what the other mode
    # left in the caches (after non-temporal passes the weights are out of L3, so the first plain pass reads
    # memory; timing that pass alone had made two modes look alike, 4.4 vs 4.8 ms on the bundled model bf16,
    # where steady passes take 3.4 vs 5.7 ms). The order alternates between rounds.
    rounds: dict[str, list[float]] = {m: [] for m in MODES}  # per mode, its best pass in each round
    try:
        with torch.inference_mode():
            one_pass()  # warm: allocations, first-call dispatch
            for r in range(ROUNDS):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    kern.set_stream_prefetch(mode, fam)
                    for _ in range(SETTLE):
                        one_pass()
                    rounds[mode].append(min(one_pass() for _ in range(TIMED)))
    except Exception as e:  # noqa: BLE001 - a measurement must never stop a model from loading
        kern.set_stream_prefetch(DEFAULT, fam)
        log.warning("%s weight prefetch left at %s: timing the layers failed (%s)", fam, DEFAULT, e)
        return None
    mode = choose(rounds)
    kern.set_stream_prefetch(mode, fam)
    log.info("%s weight prefetch %s: a pass over %d linear layers (%.0f MB) took %s (best of %d rounds)", fam, mode,
             len(layers), total / 1e6, ", ".join(f"{min(rounds[m]) * 1e3:.2f} ms {m}" for m in MODES), ROUNDS)
    return mode


def choose(rounds: dict[str, list[float]], default: str = DEFAULT, margin: float = MARGIN,
           wins_needed: int | None = None) -> str:
    """The mode to keep from each mode's best pass per round ({mode: [seconds, ..]}, the rounds aligned): another
    mode than the default only where it beat the default by the margin in every round (or in wins_needed of them),
    the fastest such (by its best pass). A best-of over all rounds let one lucky pass decide: on a Zen 4 whose
    bandwidth moves between spells the 0.6B shape's int4 model drew nta, off and l2 (timed then) in
    three loads, and through the engine (alternating processes, each mode forced, 96 tokens after a 128-token
    prompt, median of 5 generations) nta decoded at 76.8 / 64.5 / 61.4 tok/s, off at 58.2 / 65.3 / 57.8, l2 at
    58.7 / 60.8 / 57.5: the isolated pass does not see what a stream that evicts the step's other data costs,
    which is what the margin stands for."""
    base = rounds[default]

    def steady(r: list[float]) -> bool:  # won by the margin in every round (or in wins_needed of them)
        won = sum(t < (1 - margin) * b for t, b in zip(r, base, strict=True))
        return bool(r) and won >= (len(r) if wins_needed is None else wins_needed)
    wins = [m for m, r in rounds.items() if m != default and steady(r)]
    return min(wins, key=lambda m: min(rounds[m])) if wins else default


STEP_MARGIN = 0.03  # whole steps see everything a kind costs (what it evicts included): a smaller margin than MARGIN
STEP_ROUNDS, STEP_WINS = 5, 4  # a candidate must win 4 rounds of 5: a step is short, and one spell can spoil a round
STEP_TIMED = 2  # steps timed per candidate and round (the fastest counts), after one settling step


def tune_steps(step, measured: dict[str, str]) -> dict[str, str]:
    """Check the passes' choice (`tune`: {family: mode}) against whole decode steps and keep what they run fastest.

    Why: a pass over the linears alone misjudges a kind both ways. On a Zen 4 it preferred l2 for the 0.6B
    shape's int4 body while whole decodes ran slower with it; on the same machine it kept nta for the bf16 model (off
    never beat it by 5% in every round) while whole decodes, in one process with the kinds alternating, ran 1.23x
    faster with off (10 of 10 pairs). So once the engine can run a step (ModelRunner.warmup), `step()` runs one
    decode step and candidates are timed through it: the passes' choice, and every family in one kind (nta, t0,
    off, l2). The passes' choice stays unless another candidate beat it by STEP_MARGIN in STEP_WINS of STEP_ROUNDS
    rounds."""
    kern = cpu_kernels.kernels()
    candidates = {"measured": dict(measured)}
    for mode in STEP_MODES:
        if any(m != mode for m in measured.values()):
            candidates[mode] = dict.fromkeys(measured, mode)

    def use(name: str) -> None:
        for fam, mode in candidates[name].items():
            kern.set_stream_prefetch(mode, fam)

    def timed() -> float:
        t = time.perf_counter()
        step()
        return time.perf_counter() - t

    rounds: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    try:
        for r in range(STEP_ROUNDS):
            for name in names if r % 2 == 0 else names[::-1]:
                use(name)
                step()  # settling: the first step pays for the other kind's cache state
                rounds[name].append(min(timed() for _ in range(STEP_TIMED)))
    except Exception as e:  # noqa: BLE001 - a measurement must never stop a model from serving
        use("measured")
        log.warning("weight prefetch left as the passes chose: timing decode steps failed (%s)", e)
        return measured
    pick = choose(rounds, default="measured", margin=STEP_MARGIN, wins_needed=STEP_WINS)
    use(pick)
    log.info("weight prefetch by whole decode steps: %s (per round, ms: %s)", candidates[pick],
             "; ".join(f"{n} " + " ".join(f"{x * 1e3:.1f}" for x in t) for n, t in rounds.items()))
    return candidates[pick]
