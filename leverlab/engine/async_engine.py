"""AsyncLLM: the engine's step loop on a background thread, with an asyncio face for the server.

CONTRACT (the server codes against this; the implementation lands with the engine core):

    engine = AsyncLLM(EngineConfig(model=path, ...))    # loads the model, starts the step-loop thread
    engine.tokenizer          # Hugging Face tokenizer (has .apply_chat_template, .chat_template)
    engine.model_name         # the model folder's name
    engine.max_model_len      # prompt tokens + max_tokens must fit in this
    engine.config             # the EngineConfig (lever settings, for /version and bench manifests)

    async for out in engine.generate(prompt, params, request_id):   # prompt: str or list[int]
        ...   # out: RequestOutput; out.outputs has params.n CompletionOutputs (index 0..n-1),
              # each cumulative (text/token_ids only grow); out.finished on the last one.
    # generate raises, before yielding anything:
    #   RequestError      bad request (empty prompt, prompt + max_tokens > max_model_len with both numbers,
    #                     token id out of vocabulary, ...): HTTP 400
    #   EngineOverloaded  waiting queue full: HTTP 503 + Retry-After
    #   EngineDeadError   the loop died: HTTP 503
    # If the consumer stops iterating (client disconnect -> aclose()/CancelledError), the request is aborted
    # and its KV blocks are freed.

    engine.abort(request_id)         # its stream ends with a final output whose finish_reason is "abort"
    await engine.reset_prefix_cache()   # forget unused cached prefix blocks (cold benchmark runs)
    engine.stats() -> EngineStats   # running/waiting counts, KV blocks, counters for Prometheus
    engine.healthy -> bool
    await engine.shutdown(drain_timeout_s)   # stop admitting, let running requests finish, stop the loop
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from leverlab.config import EngineConfig
from leverlab.engine.llm_engine import LLMEngine
from leverlab.errors import EngineDeadError, EngineOverloaded, RequestError
from leverlab.outputs import RequestOutput
from leverlab.sampling_params import SamplingParams

log = logging.getLogger("leverlab")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int = 0  # free blocks that still hold reusable prefix KV
    counters: dict[str, float] = field(default_factory=dict)  # monotonically increasing totals

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)


class AsyncLLM:
    def __init__(self, config: EngineConfig, served_model_name: str | None = None):
        self.engine = LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        method = self.engine.runner.model.quant_method  # as loaded: a pre-quantized checkpoint names its own
        self.quantization: str | None = method.name if method is not None else None
        self.model_name = served_model_name or self.engine.model_path.rstrip("/").split("/")[-1]
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: BaseException | None = None
        self._accepting = True
        self._stop = threading.Event()
        self.integrity_errors = 0
        self._last_check = 0.0
        self._thread = threading.Thread(target=self._run, name="leverlab-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio face ---------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and self.engine.healthy

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        if not self._accepting:
            raise EngineOverloaded("the server is shutting down")
        if self.num_waiting() >= self.config.max_waiting:
            raise EngineOverloaded(f"{self.config.max_waiting} requests are already waiting; retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic()
        text, ids = self.engine.encode(prompt, params)  # RequestError surfaces here, before anything is queued
        tokenize_s = time.monotonic() - arrival
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", request_id, ids, params, arrival, text, tokenize_s))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                # The consumer went away (client disconnect, cancellation): free the request's KV blocks.
                self._inbox.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def reset_prefix_cache(self) -> int:
        """Forget unused cached prefix blocks (runs on the engine thread, between steps)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("reset", done))
        return await asyncio.wrap_future(done)

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._inbox.qsize()

    def stats(self) -> EngineStats:
        eng = self.engine
        return EngineStats(
            num_running=len(eng.scheduler.running),
            num_waiting=self.num_waiting(),
            num_free_blocks=eng.blocks.num_free,
            num_total_blocks=eng.blocks.num_blocks,
            num_cached_blocks=eng.blocks.num_cached_free,
            counters=eng.counter_snapshot(),
        )

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting; let running requests finish for up to drain_timeout_s; abort the rest; stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.healthy and (self._streams or self.engine.has_unfinished()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        self._stop.set()
        self._inbox.put(("wake",))
        await asyncio.to_thread(self._thread.join, 10.0)

    # ---- the engine thread --------------------------------------------------------------------------
    def _push(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                # Block for work only when idle; otherwise drain commands and step at once.
                try:
                    cmd = self._inbox.get(timeout=0.5) if not eng.has_unfinished() else self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    self._handle(cmd)
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if eng.has_unfinished():
                    for out in eng.step():
                        self._push(out.request_id, out)
                elif time.monotonic() - self._last_check > 10.0:
                    self._check_when_idle()
            # Commands queued while the last step ran (shutdown's aborts) still get their answer.
            while True:
                try:
                    self._handle(self._inbox.get_nowait())
                except queue.Empty:
                    break
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; every waiter must hear of it
            log.exception("engine loop died")
            self._dead = e
            for rid in list(self._streams):
                self._push(rid, EngineDeadError(f"the engine loop died: {e!r}"))

    def _check_when_idle(self) -> None:
        """While idle, check the KV accounting (free + cached + used == total, ref counts): a leak or a
        double-held block is reported at once, not discovered under load."""
        self._last_check = time.monotonic()
        try:
            self.engine.check_invariants()
        except AssertionError as e:
            log.error("KV-cache accounting is inconsistent: %s", e)
            self.integrity_errors += 1

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, arrival, text, tokenize_s = cmd
            if rid not in self._streams:  # its consumer left before it was admitted
                return
            try:
                self.engine.add_request(rid, ids, params, arrival_time=arrival, prompt_text=text,
                                        tokenize_s=tokenize_s)
            except ValueError as e:
                self._push(rid, e if isinstance(e, RequestError) else RequestError(str(e)))
        elif kind == "reset":
            cmd[1].set_result(self.engine.reset_prefix_cache())
        elif kind == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:  # a final output (finish_reason "abort"), so no stream waits forever
                self._push(cmd[1], out)
