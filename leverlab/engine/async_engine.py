"""AsyncLLM: the engine's step loop on a background thread, with an asyncio face for the server.

It implements `EngineClient` (client.py), the only face the server sees:

    engine = AsyncLLM(EngineConfig(model=path, ...))    # loads the model, starts the step-loop thread
    async for out in engine.generate(prompt, params, request_id):   # prompt: EnginePrompt (or str/list[int])
        ...   # out: RequestOutput, cumulative; out.finished on the last one

Each request's outputs go through a one-slot mailbox, not a queue: the engine thread overwrites the latest
cumulative output, so a consumer that reads slowly gets the newest state and the memory a request holds
between engine and client stays one output, whatever n, logprobs or the reader's speed.
Admission counts sequences (prompts x n): running plus waiting may not pass `capacity_seqs`
(max_num_seqs + max_waiting); the server reserves against the same number before it tokenizes anything.
If the loop dies, every open stream and every pending command gets EngineDeadError at once.
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

from leverlab import env
from leverlab.config import EngineConfig
from leverlab.engine.client import EnginePrompt
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


class _Mailbox:
    """One request's hand-off from the engine thread to its consumer on the event loop: the latest cumulative
    output (or an error), and whether there is something new. Put never blocks and never grows."""

    __slots__ = ("loop", "latest", "error", "pending", "event", "lock")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.pending = False
        self.event = asyncio.Event()
        self.lock = threading.Lock()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread (or loop thread): keep only the newest; wake the consumer once per batch of puts."""
        with self.lock:
            if isinstance(item, BaseException):
                self.error = item
            elif self.latest is None or not self.latest.finished:  # a final output is never overwritten
                self.latest = item
            wake, self.pending = not self.pending, True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self.event.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    async def get(self) -> RequestOutput:
        while True:
            with self.lock:
                if self.pending:
                    self.pending = False
                    if self.error is not None:
                        raise self.error
                    item, self.latest = self.latest, None
                    if item is not None:
                        return item
                self.event.clear()  # under the lock: a put after this sets it again
            await self.event.wait()

    async def until_finished(self) -> AsyncIterator[RequestOutput]:
        """The outputs as they come, ending after the finished one (an error is raised)."""
        while True:
            item = await self.get()
            yield item
            if item.finished:
                return


class AsyncLLM:
    def __init__(self, config: EngineConfig, served_model_name: str | None = None):
        self.engine = LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        method = self.engine.runner.model.quant_method  # as loaded: a pre-quantized checkpoint names its own
        self.quantization: str | None = method.name if method is not None else None
        # vLLM's default: the model as given (a Hub id), else the folder's name
        self.model_name = served_model_name or config.model_id or self.engine.model_path.rstrip("/").split("/")[-1]
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Mailbox] = {}
        self._inflight_seqs = 0  # sum of n over open streams: the admission count
        self.capacity_seqs = config.max_num_seqs + config.max_waiting
        # Test-only fault injection (env.TEST_FAIL_AT_STEP): the loop raises at that engine step.
        self._fail_at_step = env.test_fail_at_step()
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

    @property
    def degraded(self) -> bool:
        return False  # one engine serves whole or not at all

    def health(self) -> dict:
        return {}

    async def generate(self, prompt: EnginePrompt | str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        if not self._accepting:
            raise EngineOverloaded("the server is shutting down")
        n = params.n
        if n > self.capacity_seqs:
            raise RequestError(f"this request has {n} sequences; the engine holds at most {self.capacity_seqs} "
                               "at once (--max-num-seqs + --max-waiting)")
        if self._inflight_seqs + n > self.capacity_seqs:
            raise EngineOverloaded(f"{self._inflight_seqs} sequences are already running or waiting (at most "
                                   f"{self.capacity_seqs}); retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic()
        # An EnginePrompt was checked by the server; anything else is checked here, once, before queueing.
        checked = self.engine.encode(prompt, params)
        box = _Mailbox(asyncio.get_running_loop())
        self._streams[request_id] = box
        self._inflight_seqs += n
        finished = False
        try:
            if self._dead is not None:  # died between the check above and the registration
                raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
            self._inbox.put(("add", request_id, checked, params, arrival))
            async for item in box.until_finished():
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            self._inflight_seqs -= n
            if not finished:
                # The consumer went away (client disconnect, cancellation): free the request's KV blocks.
                self._inbox.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def reset_prefix_cache(self) -> int:
        """Forget unused cached prefix blocks (runs on the engine thread, between steps)."""
        if not self.healthy:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("reset", done))
        if self._dead is not None:
            self._fail_commands()
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
        box = self._streams.get(request_id)
        if box is not None:
            box.put(item)

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
                if not eng.healthy:  # a tensor-parallel rank died while idle: nothing can run any more
                    raise eng.executor.error or EngineDeadError("engine unhealthy")
                if eng.has_unfinished():
                    if self._fail_at_step is not None and eng.counters["steps"] >= self._fail_at_step:
                        raise RuntimeError(f"injected engine failure at step {self._fail_at_step} "
                                           "(LEVERLAB_TEST_FAIL_AT_STEP)")
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
            self._fail_commands()

    def _fail_commands(self) -> None:
        """After the loop died: answer the commands nobody will run (a reset must not hang)."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "reset" and not cmd[1].done():
                cmd[1].set_exception(EngineDeadError(f"the engine loop has stopped: {self._dead!r}"))

    def _check_when_idle(self) -> None:
        """While idle, check the KV accounting (free + cached + used == total, ref counts): a leak or a
        double-held block is reported at once, not discovered under load."""
        self._last_check = time.monotonic()
        self.integrity_errors += not self.engine.kv_accounting_ok()

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, arrival = cmd
            if rid not in self._streams:  # its consumer left before it was admitted
                return
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except ValueError as e:
                self._push(rid, e if isinstance(e, RequestError) else RequestError(str(e)))
        elif kind == "reset":
            cmd[1].set_result(self.engine.reset_prefix_cache())
        elif kind == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:  # a final output (finish_reason "abort"), so no stream waits forever
                self._push(cmd[1], out)
