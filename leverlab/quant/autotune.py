"""How many activation rows each quantized linear streams, measured at load.

The streaming int8/int4 kernels (kernels/csrc/quant_linear.cpp) read each weight once and win at one row; their
cost grows with every row. fbgemm's int8 GEMM over the int8 copy (int8_gemm.py) costs ~0.2 ms per call before
any work (per-row activation quantization, the quantized-tensor dispatch) and then grows slowly. Where the two
cross depends on the matrix and the machine. Measured here (one thread, CPU time) at 16 rows: int8 640x384
streamed 1.5x faster than fbgemm, 2048x384 0.63x; int4 on the Qwen3-0.6B shape's 4096x1024 was 0.52x already
at 4 rows. A fixed cut (16 rows) kept bigger models' layers on the slower kernel from a few rows on (int4
at 16 rows: 2.2x fbgemm's time per layer there). So each
distinct (method, shape, dtype) is timed once at load at ROWS rows, both ways, and its layers stream up to the
largest row count (from 1, without a gap) at which fbgemm is not clearly (MARGIN) faster.

The fused decode step (models/fused.py) streams every layer; it takes a batch of `fused_rows(...)` rows or fewer:
while the layers' streaming time stays within the module path's (each layer at its faster kernel) plus the
module path's own cost per layer, which the fused step saves.

LEVERLAB_STREAM_ROWS=N fixes every layer at N (0..16) instead of measuring: a choice by timing can differ
between runs, and the two kernels quantize activations differently (per 32-block against per row).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from leverlab.quant.base import STREAMING_MAX_ROWS

log = logging.getLogger("leverlab")

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
MARGIN = 0.1  # fbgemm must be this much faster to take rows from streaming: timings at load are noisy here


def module_cost_per_layer_s(rows: int) -> float:
    """What the module path costs per decoder layer beyond its kernels (Python, dispatch, attention's tensors),
    which the fused step saves. Measured on the bundled model in bf16 (the same linear kernels both ways), CPU
    time per decode step, one thread: 8.86 ms against 4.10 fused at 1 sequence, 20.8 against 13.1 at 16, so
    ~0.6 ms per layer at 1 row and ~1.0 at 16."""
    return 0.57e-3 + 0.026e-3 * rows


def eligible(layer) -> bool:
    """A layer with both a streaming copy and fbgemm's int8 copy, whose method may switch between them at any
    row count (int8-woq keeps weight-only arithmetic up to 8 rows, so it does not)."""
    m = layer.quant_method
    state = layer.kernel_state
    return (state.stream is not None and state.int8_key is not None and m.w8a8_min_rows is not None
            and m.w8a8_min_rows <= 2)


def _best_time(layer, x: torch.Tensor, stream_rows: int, reps: int) -> float:
    """The best of `reps` calls of the layer's kernel for x, with the layer streaming up to stream_rows rows."""
    layer.kernel_state.stream_rows = stream_rows
    layer.quant_method.apply(layer, x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        layer.quant_method.apply(layer, x)
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(layer, reps: int = 3) -> dict[int, tuple[float, float]]:
    """rows -> (streaming seconds, batched seconds) for this layer, in its activation dtype."""
    g = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    for rows in ROWS:
        x = torch.randn(rows, layer.in_features, generator=g).to(layer.params_dtype)
        out[rows] = (_best_time(layer, x, STREAMING_MAX_ROWS, reps), _best_time(layer, x, 0, reps))
    return out


def tune(layers: list) -> None:
    """Set `stream_rows` (and `row_times`, for fused_rows) on every quantized layer."""
    fixed = os.environ.get("LEVERLAB_STREAM_ROWS")
    cache: dict[tuple, dict[int, tuple[float, float]]] = {}
    t0 = time.perf_counter()
    for layer in layers:
        layer.kernel_state.stream_rows, layer.kernel_state.row_times = STREAMING_MAX_ROWS, None
        if not eligible(layer):
            continue
        if fixed is not None:
            layer.kernel_state.stream_rows = max(0, min(STREAMING_MAX_ROWS, int(fixed)))
            continue
        m = layer.quant_method
        key = (m.name, getattr(m, "group_size", None), layer.out_features, layer.in_features, layer.params_dtype,
               layer.bias is not None)
        if key not in cache:
            with torch.inference_mode():
                cache[key] = _measure(layer)
        times = cache[key]
        layer.kernel_state.row_times = times
        rows = 1  # one row always streams: it reads the weights once, fbgemm's fixed cost alone is larger
        for r in ROWS[1:]:  # the largest row count reached without a clear loss on the way
            if times[r][0] > (1 + MARGIN) * times[r][1]:
                break
            rows = r
        layer.kernel_state.stream_rows = rows
    if cache:
        log.info("quantized linears: streaming kernels up to %s rows (by shape), fbgemm past that; timed in %.1f s",
                 sorted({layer.kernel_state.stream_rows for layer in layers if eligible(layer)}), time.perf_counter() - t0)


def fused_rows(layers: list, num_decoder_layers: int) -> int:
    """The most rows the fused step takes when it streams every one of `layers`."""
    timed = [layer for layer in layers if layer.kernel_state.row_times is not None]
    fixed = [layer.kernel_state.stream_rows for layer in layers if layer.kernel_state.row_times is None and eligible(layer)]
    if fixed:  # LEVERLAB_STREAM_ROWS
        return min(fixed)
    if not timed:
        return STREAMING_MAX_ROWS
    rows = 0
    for r in ROWS:
        fused = sum(layer.kernel_state.row_times[r][0] for layer in timed)
        modules = sum(min(layer.kernel_state.row_times[r]) for layer in timed) + num_decoder_layers * module_cost_per_layer_s(r)
        if fused > (1 + MARGIN) * modules:
            break
        rows = r
    return max(rows, 1)
