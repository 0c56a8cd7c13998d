"""Static batching as a client-side workload: waves of N, the next only after the whole wave ends, and each
request's wait for its wave counted in its TTFT and E2E (figures exact against a stand-in send)."""

from __future__ import annotations

import asyncio

from leverlab.bench.records import BenchRequest, RequestRecord
from leverlab.bench.strategies import static_batches

# seconds each request takes: the waves are (0.05, 0.20) and (0.10, 0.05)
DURATIONS = {"a": 0.05, "b": 0.20, "c": 0.10, "d": 0.05}


def test_waves_run_to_their_longest_member_and_the_wait_counts():
    sent: list[tuple[str, float]] = []
    loop_t0: list[float] = []

    async def send(req: BenchRequest) -> RequestRecord:
        now = asyncio.get_running_loop().time()
        sent.append((req.id, now - loop_t0[0]))
        await asyncio.sleep(DURATIONS[req.id])
        d = DURATIONS[req.id]
        return RequestRecord(req.id, "g", "b", 4, ok=True, ttft_s=0.01, e2e_s=d, output_tokens=4)

    async def main():
        loop_t0.append(asyncio.get_running_loop().time())
        reqs = [BenchRequest(id=i, bucket="b", output_len=4, prompt="p") for i in "abcd"]
        return await static_batches(reqs, 2, send)

    recs, dur = asyncio.run(main())
    when = dict(sent)
    assert when["a"] < 0.03 and when["b"] < 0.03  # the first wave goes at once
    assert when["c"] >= 0.19 and when["d"] >= 0.19  # the second only after b, the longest, ended
    by = {r.id: r for r in recs}
    # a finished at ~0.05 and its client waited ~0.15 for b: that wait is in c's latency (same client slot)
    assert 0.12 < by["c"].queue_wait_s < 0.2 and by["c"].e2e_s == DURATIONS["c"] + by["c"].queue_wait_s
    assert by["d"].queue_wait_s < 0.03  # b's client was the last one ready
    assert by["c"].ttft_s == 0.01 + by["c"].queue_wait_s
    assert by["a"].queue_wait_s == 0.0 and by["b"].queue_wait_s == 0.0
    assert 0.29 < dur < 0.5
