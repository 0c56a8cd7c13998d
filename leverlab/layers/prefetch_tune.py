"""Whether the streaming kernels prefetch their weights non-temporally: measured per model at load (CPU).

PREFETCHNTA (csrc/stream_hint.h) keeps a decode step's weight stream from evicting the rest of the working set.
That pays where the weights cannot stay in the last-level cache anyway (a Zen 3, sessions 5-7: 8-20% faster per
step) and costs where they could: on an Intel Xeon whose L3 is a victim cache, lines fetched non-temporally skip
L2 and L3, so a model that fits in L3 was read from memory again every step (the bundled model, bf16, one thread:
171 tok/s with the prefetch, 265-294 without; session 8). So the loader times passes over the model's linear
layers at one activation row, as a decode step reads them, both ways, each after a settling pass in its own mode,
and keeps the faster. LEVERLAB_NO_STREAM_
PREFETCH=1 turns it off without measuring.
"""

from __future__ import annotations

import logging
import time

import torch

from leverlab import env
from leverlab.layers import cpu_kernels
from leverlab.layers.linear import Linear

log = logging.getLogger("leverlab")

MAX_BYTES = 1 << 30  # past this a pass is too long to time at load, and no cache keeps the weights either way
MARGIN = 0.05  # off must be this much faster: the default (on) protects the rest of the step's working set
ROUNDS = 2
SETTLE = 1  # untimed passes after each switch: the first pass pays for the other mode's cache state
TIMED = 2


def _bytes(layer: Linear) -> int:
    m = layer.quant_method
    if m is not None:
        return m.bytes_read(layer, 1)
    return layer.weight.numel() * layer.weight.element_size()


def tune(model: torch.nn.Module) -> bool | None:
    """Set the kernels' prefetch for this model; returns the choice (None: not measured)."""
    kern = cpu_kernels.kernels()
    if kern is None:
        return None
    if env.flag("LEVERLAB_NO_STREAM_PREFETCH"):
        kern.set_stream_prefetch(False)
        return False
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or sum(_bytes(m) for m in layers) > MAX_BYTES:
        return None
    dtype = model.model.embed_tokens.weight.dtype  # the activations' dtype (a quantized layer's weight is not)
    xs = [torch.randn(1, m.in_features, dtype=dtype) for m in layers]

    def one_pass() -> float:
        t = time.perf_counter()
        for m, x in zip(layers, xs):
            Linear.forward(m, x)  # the layer's own kernel; no tensor-parallel collective
        return time.perf_counter() - t

    # Each mode is timed in its own steady state: a pass right after a switch still pays for what the other mode
    # left in the caches (after non-temporal passes the weights are out of L3, so the first plain pass reads
    # memory; timing that pass alone had made the two modes look alike, 4.4 vs 4.8 ms on the bundled model
    # bf16, where steady passes take 3.4 vs 5.7 ms: session 9).
    best = {True: float("inf"), False: float("inf")}
    try:
        with torch.inference_mode():
            one_pass()  # warm: allocations, first-call dispatch
            for r in range(ROUNDS):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    kern.set_stream_prefetch(on)
                    for _ in range(SETTLE):
                        one_pass()
                    best[on] = min(best[on], *(one_pass() for _ in range(TIMED)))
    except Exception as e:  # noqa: BLE001 - a measurement must never stop a model from loading
        kern.set_stream_prefetch(True)
        log.warning("weight prefetch left on: timing the layers failed (%s)", e)
        return None
    on = not best[False] < (1 - MARGIN) * best[True]
    kern.set_stream_prefetch(on)
    log.info("weight prefetch %s: a pass over the linear layers took %.2f ms with it, %.2f ms without",
             "on" if on else "off", best[True] * 1e3, best[False] * 1e3)
    return on
