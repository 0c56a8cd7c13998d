"""Load strategies: how requests are released to the server. Each returns (records in request order,
duration_s), where duration is first send -> last completion, as vllm's benchmark duration.

- concurrent(c): closed loop, exactly c requests in flight until the list runs out (c=1: one at a time,
  single-request latency with no batching).
- static_batches(n): closed loop of n clients served in static batches: a request waits until the batch
  before it has finished entirely (it runs to its longest member) and then goes out with the next n; the wait
  counts in its TTFT and E2E, as it would for a user whose request sat in the server's queue.
- poisson(rate): open loop, exponential inter-arrival gaps from a seeded generator, optionally capped at
  max_concurrency in flight.
Warm-up is a separate call whose records the runner keeps apart from every aggregate.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from leverlab.bench.records import BenchRequest, RequestRecord

Send = Callable[[BenchRequest], Awaitable[RequestRecord]]


async def concurrent(
    reqs: Sequence[BenchRequest], concurrency: int, send: Send
) -> tuple[list[RequestRecord], float]:
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    results: list[RequestRecord | None] = [None] * len(reqs)
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < len(reqs):
            i = next_i
            next_i += 1  # no await between the test and the increment: safe on one event loop
            results[i] = await send(reqs[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(reqs)))))
    return [r for r in results if r is not None], time.perf_counter() - t0


async def static_batches(
    reqs: Sequence[BenchRequest], batch: int, send: Send
) -> tuple[list[RequestRecord], float]:
    """Static batching as a client-side workload, so it measures the same on any engine: waves of `batch`
    requests sent together, the next wave only once every member of this one has finished. Each of the
    `batch` clients issues its next request as soon as its own previous one is done (as concurrent() does);
    under static batching that request waits for the wave to end. The wait (the wave's end minus the moment
    the client was ready) is added to TTFT and E2E and kept as queue_wait_s. Not modelled: an open-loop
    queue filling a batch (here a batch is always full but for the last)."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    ready: list[float | None] = [None] * batch  # when each client's next request was ready (None: at the start)
    for start in range(0, len(reqs), batch):
        wave = reqs[start : start + batch]
        sent = time.perf_counter()
        done = await asyncio.gather(*(_timed(send, r) for r in wave))
        for i, (rec, finished) in enumerate(done):
            r = ready[i]
            wait = 0.0 if r is None else max(0.0, sent - r)
            rec.queue_wait_s = wait
            rec.start_s -= wait
            rec.e2e_s += wait
            if rec.ttft_s is not None:
                rec.ttft_s += wait
            ready[i] = finished
            records.append(rec)
    return records, time.perf_counter() - t0


async def _timed(send: Send, req: BenchRequest) -> tuple[RequestRecord, float]:
    rec = await send(req)
    return rec, time.perf_counter()


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from start) of n requests at `rate` req/s: cumulative exponential gaps, rescaled so the
    last one lands at n / rate (vllm does the same, so throughput does not drift 1-2% with the seed).
    The first request goes at t=0."""
    if rate <= 0:
        raise ValueError("request rate must be > 0")
    rng = random.Random(seed)
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]
    offsets: list[float] = []
    acc = 0.0
    for g in gaps:
        acc += g
        offsets.append(acc)
    if n > 1 and offsets[-1] > 0:
        scale = (n / rate) / offsets[-1]
        offsets = [o * scale for o in offsets]
    return offsets


async def poisson(
    reqs: Sequence[BenchRequest],
    rate: float,
    send: Send,
    *,
    seed: int = 0,
    max_concurrency: int | None = None,
) -> tuple[list[RequestRecord], float]:
    offsets = poisson_offsets(len(reqs), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            return await send(reqs[i])
        async with sem:
            return await send(reqs[i])

    records = await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return list(records), time.perf_counter() - t0


async def warmup(
    reqs: Sequence[BenchRequest], n: int, send: Send, concurrency: int = 1
) -> list[RequestRecord]:
    """n requests cycling through reqs, up to `concurrency` at once (so the connection pool the run will
    use is open before measuring); their records are never aggregated."""
    if n <= 0 or not reqs:
        return []
    records, _ = await concurrent([reqs[i % len(reqs)] for i in range(n)], max(1, min(n, concurrency)), send)
    return records
