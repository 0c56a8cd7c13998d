"""A stand-in that implements EngineClient (leverlab/engine/client.py) as AsyncLLM does, for in-process tests of faults the real engine cannot be made
to show on demand (a dead engine, an exact overload point). Tokens are a fixed walk through the vocab."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from leverlab.engine.client import EnginePrompt
from leverlab.errors import EngineDeadError, EngineOverloaded, RequestError
from leverlab.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    counters: dict = field(default_factory=dict)


class FakeEngine:
    def __init__(
        self,
        tokenizer,
        max_model_len: int = 128,
        max_running: int = 4,
        max_waiting: int = 4,
        step_s: float = 0.002,
    ):
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.capacity_seqs = 1024  # the fake's own overload point (max_running + max_waiting) comes first
        self.config = SimpleNamespace(model="fake")
        self.quantization = None
        self.healthy = True
        self.degraded = False
        self.dead = False
        self.max_running, self.max_waiting, self.step_s = max_running, max_waiting, step_s
        self.running: set[str] = set()
        self.waiting = 0
        self.aborted: list[str] = []
        self.total_blocks = 64
        self.on_step = None  # optional callback(step) run before each output, for tests to act mid-stream

    def stats(self) -> FakeStats:
        return FakeStats(
            len(self.running),
            self.waiting,
            self.total_blocks,
            self.total_blocks - 2 * len(self.running),
            {"prefix_cache_hits": 3},
        )

    def health(self) -> dict:
        return {}

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def shutdown(self, drain_timeout_s: float) -> None:
        self.healthy = False

    async def reset_prefix_cache(self) -> int:
        return 0

    async def generate(self, prompt, params, request_id):
        if self.dead:
            raise EngineDeadError("step loop died")
        assert isinstance(prompt, EnginePrompt), "the server validates prompts before they reach an engine"
        ids = list(prompt.token_ids)
        if not ids:
            raise RequestError("prompt must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"{len(ids)} + {params.max_tokens} > {self.max_model_len}")
        if len(self.running) >= self.max_running and self.waiting >= self.max_waiting:
            raise EngineOverloaded("waiting queue full")
        m = RequestMetrics(arrival_time=time.monotonic())
        self.waiting += 1
        try:
            while len(self.running) >= self.max_running:
                await asyncio.sleep(self.step_s)
        finally:
            self.waiting -= 1
        self.running.add(request_id)
        m.first_scheduled_time = time.monotonic()
        outs = [
            CompletionOutput(i, "", [], [] if params.logprobs is not None else None) for i in range(params.n)
        ]
        finished = False
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_s)
                if self.on_step is not None:
                    self.on_step(step)
                if self.dead:
                    raise EngineDeadError("step loop died")
                now = time.monotonic()
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
                m.token_times.append(now)
                for o in outs:
                    tid = 10 + (ids[-1] + 7 * step + o.index) % 200
                    o.token_ids.append(tid)
                    o.text = self.tokenizer.decode(o.token_ids)
                    if o.logprobs is not None:
                        o.logprobs.append({tid: -0.5, tid + 1: -1.5, tid + 2: float("-inf")})
                    if step == params.max_tokens - 1:
                        o.finish_reason = "length"
                finished = step == params.max_tokens - 1
                if finished:
                    m.finished_time = now
                yield RequestOutput(request_id, None, ids, [_copy(o) for o in outs], finished, m)
        finally:
            self.running.discard(request_id)
            if not finished:
                self.aborted.append(request_id)


def _copy(o: CompletionOutput) -> CompletionOutput:
    lp = None if o.logprobs is None else list(o.logprobs)
    return CompletionOutput(o.index, o.text, list(o.token_ids), lp, o.finish_reason, o.stop_reason)
