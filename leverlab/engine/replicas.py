"""Data parallelism (`--data-parallel-size N`): N engine processes behind one EngineClient.

    server / LLM ── ReplicaSet ── router.py picks a replica per request (prefix affinity, else least loaded)
                        │ one pipe per replica (replica.py: the messages)
                        ├── replica 0: LLMEngine (its own KV cache; its own TP ranks when TP > 1)
                        └── replica 1: ...

Each replica gets its share of the machine: cores // (N x TP) threads per rank (one for small models, as at
N = 1), and 1/N of the KV-cache budget (--kv-cache-memory, its 2 GiB default, or the memory fraction);
--num-kv-blocks stays a per-replica count. A reader thread per replica hands its outputs to the requests'
sinks (an asyncio mailbox for the server, a queue for LLM).

A replica that dies (killed, OOM, a dead TP rank) is taken out of rotation when its pipe closes: its requests
get EngineDeadError naming it (the server answers 503, or an error event mid-stream), the router forgets
its cached prefixes, the others go on, and `degraded` turns True (/health says so). The set is unhealthy only
when no replica is left.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from leverlab import env
from leverlab.config import EngineConfig, default_model_path
from leverlab.engine.async_engine import EngineStats, _Mailbox
from leverlab.engine.client import EnginePrompt, to_engine_prompt
from leverlab.engine.replica import ReplicaArgs, replica_main
from leverlab.engine.router import Router, RouterConfig
from leverlab.errors import EngineDeadError, EngineOverloaded, RequestError, UnsupportedLever
from leverlab.models.config import ModelConfig
from leverlab.models.tokenizer import load_tokenizer
from leverlab.outputs import RequestOutput
from leverlab.sampling_params import SamplingParams

log = logging.getLogger("leverlab")

START_TIMEOUT_S = 600  # loading and warming a replica (compiled mode compiles here)

Sink = Callable[[RequestOutput | BaseException], None]


def replica_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """One replica's config: its share of the threads and of the KV-cache budget."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    threads = config.num_threads or max(1, env.default_threads(model_config, config.dtype) // (n * tp))
    kv_memory = (config.kv_cache_memory or 2 << 30) // n if config.num_kv_blocks is None else None
    fraction = config.kv_cache_memory_fraction / n if config.kv_cache_memory_fraction is not None else None
    return dataclasses.replace(config, data_parallel_size=1, num_threads=threads, kv_cache_memory=kv_memory,
                               kv_cache_memory_fraction=fraction)


@dataclass
class ReplicaSetStats(EngineStats):
    """EngineStats summed over the live replicas (counters over all, dead ones' last totals included, so they
    never go down), plus each replica's own: (index, alive, its stats or None before the first)."""

    replicas: list[tuple[int, bool, EngineStats | None]] = field(default_factory=list)


@dataclass
class Replica:
    index: int
    proc: mp.process.BaseProcess
    conn: object
    pid: int = 0
    alive: bool = True
    error: str | None = None
    stats: EngineStats | None = None
    sinks: dict[str, Sink] = field(default_factory=dict)
    loads: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (seqs, tokens) routed
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class ReplicaSet:
    """An EngineClient (client.py) over N replica processes; also the engine of LLM(data_parallel_size=N)."""

    def __init__(self, config: EngineConfig, served_model_name: str | None = None):
        if config.data_parallel_size < 2:
            raise ValueError("ReplicaSet is for data_parallel_size >= 2; one replica is AsyncLLM / LLMEngine")
        if (config.nnodes or 1) > 1:
            raise UnsupportedLever("--data-parallel-size with --nnodes > 1 is not built: replicas run on the "
                                   "serving host (tensor parallelism spans hosts)")
        self.config = config.resolve_models()  # a Hub id becomes its cached folder (hub.py)
        path = str(config.model or default_model_path())
        self.model_config = ModelConfig.from_folder(path, config.trust_remote_code)
        self.tokenizer = load_tokenizer(path, config.tokenizer)
        self.vocab_size = self.model_config.vocab_size
        self.model_name = served_model_name or config.model_id or path.rstrip("/").split("/")[-1]
        self.per_replica_seqs = config.max_num_seqs + config.max_waiting
        self.router = Router(RouterConfig(block_size=config.block_size, affinity=config.enable_prefix_caching),
                             config.data_parallel_size)
        self._lock = threading.Lock()  # routing and the replicas' request tables (event loop vs readers)
        self._resets: dict[int, tuple[concurrent.futures.Future, set[int], list[int]]] = {}
        self._tokens = itertools.count()
        self._accepting = True
        self._closed = False
        self.replicas: list[Replica] = []
        rcfg = replica_config(config, self.model_config)
        ctx = mp.get_context("spawn")  # fresh interpreters; not daemonic: a replica may start TP ranks
        for i in range(config.data_parallel_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=replica_main, args=(ReplicaArgs(i, rcfg, child, os.getpid()),),
                            name=f"leverlab-replica{i}")
            p.start()
            child.close()
            self.replicas.append(Replica(i, p, parent))
        atexit.register(self.close)
        try:
            infos = [self._wait_ready(r) for r in self.replicas]
        except BaseException:
            self.close()
            raise
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.quantization = infos[0]["quantization"]
        for r in self.replicas:
            threading.Thread(target=self._read, args=(r,), name=f"leverlab-replica{r.index}-reader",
                             daemon=True).start()
        log.info("data parallel: %d replicas (pids %s), %d thread(s) per rank, %s KV blocks each",
                 len(self.replicas), [r.pid for r in self.replicas], rcfg.num_threads,
                 rcfg.num_kv_blocks or f"{(rcfg.kv_cache_memory or 0) / 2**20:.0f} MiB of")

    def _wait_ready(self, r: Replica) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not r.conn.poll(0.2):
            if not r.proc.is_alive():
                raise EngineDeadError(f"data-parallel replica {r.index} exited while starting "
                                      f"(exit code {r.proc.exitcode}); see its log above")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"data-parallel replica {r.index} did not start within {START_TIMEOUT_S} s")
        msg = r.conn.recv()
        if msg[0] == "failed":
            _, kind, text = msg
            raise {"unsupported": UnsupportedLever, "value": ValueError}.get(kind, OSError)(text)
        r.pid = msg[1]["pid"]
        return msg[1]

    # ---- health -------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Serving: at least one replica is left."""
        return not self._closed and any(r.alive for r in self.replicas)

    @property
    def degraded(self) -> bool:
        return any(not r.alive for r in self.replicas)

    def health(self) -> dict:
        """For /health: which replicas serve, and why the others left."""
        return {"replicas_up": sum(r.alive for r in self.replicas),
                "replicas": [{"index": r.index, "pid": r.pid, "up": r.alive, "error": r.error} for r in self.replicas]}

    @property
    def capacity_seqs(self) -> int:
        return self.per_replica_seqs * len(self.replicas)

    # ---- requests -----------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | EnginePrompt, params: SamplingParams) -> EnginePrompt:
        return to_engine_prompt(prompt, params.max_tokens, self.tokenizer, self.vocab_size, self.max_model_len)

    def submit(self, request_id: str, prompt: EnginePrompt, params: SamplingParams, sink: Sink,
               arrival: float, bounded: bool = True) -> int:
        """Route the request and send it; outputs (and an error, if its replica dies) go to `sink`.
        bounded: refuse (EngineOverloaded) when every live replica holds its --max-num-seqs + --max-waiting."""
        n = params.n
        if n > self.per_replica_seqs:
            raise RequestError(f"this request has {n} sequences; a replica holds at most {self.per_replica_seqs} "
                               "at once (--max-num-seqs + --max-waiting)")
        tokens = len(prompt.token_ids) + (params.max_tokens or 0) * n
        keys = self.router.keys(prompt.token_ids)
        with self._lock:
            if any(request_id in r.sinks for r in self.replicas):
                raise ValueError(f"request id {request_id!r} is already in use")
            live = [r.index for r in self.replicas if r.alive]
            if not live:
                raise EngineDeadError("no data-parallel replica is left: " + "; ".join(
                    filter(None, (r.error for r in self.replicas))))
            room = [i for i in live if not bounded or self.router.loads[i].seqs + n <= self.per_replica_seqs]
            if not room:
                raise EngineOverloaded(f"every replica holds {self.per_replica_seqs} sequences; retry later")
            i = self.router.choose(keys, room)
            self.router.record(keys, i)
            self.router.start(i, n, tokens)
            r = self.replicas[i]
            r.sinks[request_id] = sink
            r.loads[request_id] = (n, tokens)
        if not self._send(r, ("add", request_id, prompt, params, arrival)):
            self._release(r, request_id)
            raise EngineDeadError(f"data-parallel replica {i} is gone: {r.error}")
        return i

    async def generate(self, prompt: EnginePrompt | str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError("no data-parallel replica is left")
        if not self._accepting:
            raise EngineOverloaded("the server is shutting down")
        checked = self.encode(prompt, params)
        box = _Mailbox(asyncio.get_running_loop())
        i = self.submit(request_id, checked, params, box.put, time.monotonic())
        r = self.replicas[i]
        finished = False
        try:
            async for item in box.until_finished():
                finished = item.finished
                yield item
        finally:
            self._release(r, request_id)
            if not finished:  # the consumer left (disconnect, cancellation): free its KV blocks
                self._send(r, ("abort", request_id))

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if request_id in r.sinks:
                self._send(r, ("abort", request_id))

    def _release(self, r: Replica, request_id: str) -> None:
        with self._lock:
            r.sinks.pop(request_id, None)
            load = r.loads.pop(request_id, None)
            if load is not None:
                self.router.finish(r.index, *load)

    def _send(self, r: Replica, msg) -> bool:
        if not r.alive:
            return False
        try:
            with r.send_lock:
                r.conn.send(msg)
            return True
        except (OSError, EOFError, BrokenPipeError):
            return False  # its reader marks it dead

    # ---- the replicas' side -------------------------------------------------------------------------
    def _read(self, r: Replica) -> None:
        """Hand a replica's messages to their requests until its pipe closes; then take it out of rotation."""
        reason = None
        while True:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                for out in msg[1]:
                    sink = r.sinks.get(out.request_id)
                    if sink is not None:
                        sink(out)
            elif kind == "stats":
                r.stats = msg[1]
            elif kind == "error":
                sink = r.sinks.get(msg[1])
                if sink is not None:
                    sink(msg[2])
            elif kind == "reset":
                self._reset_answer(msg[1], r.index, msg[2])
            elif kind == "dead":
                reason = msg[1]
        self._lost(r, reason)

    def _lost(self, r: Replica, reason: str | None) -> None:
        if self._closed or not r.alive:
            return
        r.proc.join(timeout=2)
        code = r.proc.exitcode
        how = "still running" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"
        r.error = f"data-parallel replica {r.index} (pid {r.pid}) died ({how})" + (f": {reason}" if reason else "")
        log.error("%s; it is out of rotation, the other replicas go on", r.error)
        with self._lock:
            r.alive = False
            self.router.forget(r.index)
            sinks = list(r.sinks.values())
        for sink in sinks:
            sink(EngineDeadError(f"{r.error}; this request was on it and failed, retry it"))
        for token in list(self._resets):
            self._reset_answer(token, r.index, 0)

    # ---- admin --------------------------------------------------------------------------------------
    async def reset_prefix_cache(self) -> int:
        """Forget unused cached prefix blocks on every live replica; the number of blocks in all."""
        token = next(self._tokens)
        with self._lock:
            self.router.reset()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        waiting = {r.index for r in self.replicas if r.alive}
        self._resets[token] = (fut, waiting, [0])
        for r in self.replicas:
            if r.index in waiting and not self._send(r, ("reset", token)):
                self._reset_answer(token, r.index, 0)
        if not waiting:
            self._resets.pop(token, None)
            fut.set_result(0)
        return await asyncio.wrap_future(fut)

    def _reset_answer(self, token: int, index: int, blocks: int) -> None:
        with self._lock:
            entry = self._resets.get(token)
            if entry is None or index not in entry[1]:
                return
            fut, waiting, total = entry
            waiting.discard(index)
            total[0] += blocks
            if not waiting:
                del self._resets[token]
                fut.set_result(total[0])

    def stats(self) -> ReplicaSetStats:
        per = [(r.index, r.alive, r.stats) for r in self.replicas]
        live = [s for _, alive, s in per if alive and s is not None]
        counters: dict[str, float] = {}
        for _, _, s in per:
            for k, v in (s.counters if s is not None else {}).items():
                counters[k] = counters.get(k, 0) + v
        counters["dp_affinity_routed"] = self.router.affinity_routed
        counters["dp_replicas_lost"] = sum(not r.alive for r in self.replicas)
        return ReplicaSetStats(
            num_running=sum(s.num_running for s in live),
            num_waiting=sum(s.num_waiting for s in live),
            num_free_blocks=sum(s.num_free_blocks for s in live),
            num_total_blocks=sum(s.num_total_blocks for s in live),
            num_cached_blocks=sum(s.num_cached_blocks for s in live),
            counters=counters,
            replicas=per,
        )

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting; let running requests finish for up to drain_timeout_s; abort the rest; stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.healthy and any(r.sinks for r in self.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop every replica (the rest of their requests aborted); idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self.replicas:
            self._send(r, ("stop",))
        for r in self.replicas:
            r.proc.join(timeout=15)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(timeout=5)
            for sink in list(r.sinks.values()):
                sink(EngineDeadError("the engine was shut down before this request finished"))
        atexit.unregister(self.close)
