"""One data-parallel replica: a process holding a whole engine (LLMEngine, with its own KV cache, and its own
tensor-parallel ranks when TP > 1), driven over a pipe by the server's ReplicaSet (replicas.py).

Messages, all pickled tuples on one duplex multiprocessing Connection:
  in   ("add", request_id, EnginePrompt, SamplingParams, arrival)   ("abort", request_id)
       ("reset", token)   ("stop",)
  out  ("ready", info)   ("failed", kind, message)   ("out", [RequestOutput, ...])   ("error", request_id, exc)
       ("stats", EngineStats)   ("reset", token, blocks)   ("dead", message)
Outputs are cumulative, as AsyncLLM's are, one message per step for all requests the step changed. Arrival
times cross as time.monotonic() values: CLOCK_MONOTONIC is one clock for every process of the machine, so a
request's TTFT and queue time stay right though it was timed in two processes.

The loop is AsyncLLM's, with the pipe as its inbox. It leaves when told, when the server's process is gone
(a watchdog on the parent pid: no orphans), or when the engine dies (then it says why first).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from leverlab.config import EngineConfig
from leverlab.errors import EngineDeadError, RequestError, UnsupportedLever
from leverlab.worker.parent_watch import exit_with_parent

log = logging.getLogger("leverlab")

STATS_INTERVAL_S = 0.1  # while busy, at most this often (the server reads the latest at each scrape)


@dataclass
class ReplicaArgs:
    index: int
    config: EngineConfig
    conn: Connection
    parent_pid: int


def replica_main(args: ReplicaArgs) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s replica{args.index} %(levelname)s %(name)s: %(message)s")
    exit_with_parent(args.parent_pid, "leverlab-replica-parent-watch")
    # Ctrl-C reaches the whole process group: the server drains and then stops the replicas itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = args.conn
    from leverlab.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(args.config)
    except Exception as e:  # noqa: BLE001 - the server re-raises it with the same meaning (exit 2 or 1)
        kind = "unsupported" if isinstance(e, UnsupportedLever) else "value" if isinstance(e, ValueError) else "os"
        conn.send(("failed", kind, f"replica {args.index}: {e}"))
        return
    method = engine.runner.model.quant_method
    conn.send(("ready", {"pid": os.getpid(), "max_model_len": engine.max_model_len,
                         "quantization": method.name if method is not None else None}))
    try:
        Loop(engine, conn).run()
    except (EOFError, OSError, BrokenPipeError):
        pass  # the server went away
    except BaseException as e:  # noqa: BLE001 - the engine died: say why, then leave
        log.exception("replica %d: engine loop died", args.index)
        try:
            conn.send(("dead", f"{e}"))
        except Exception:  # noqa: BLE001 - the pipe may be gone too
            pass
        os._exit(1)
    finally:
        engine.close()


class Loop:
    def __init__(self, engine, conn: Connection):
        self.engine, self.conn = engine, conn
        self.stopped = False
        self.dirty = True  # state changed since the last stats message
        self.last_stats = 0.0
        self.last_check = time.monotonic()
        self.integrity_errors = 0

    def run(self) -> None:
        eng = self.engine
        while not self.stopped:
            # Block for commands only when idle; otherwise take what has arrived and step at once.
            if self.conn.poll(0 if eng.has_unfinished() else 0.5):
                while not self.stopped and self.conn.poll(0):
                    self.handle(self.conn.recv())
                    self.dirty = True
            if self.stopped:
                return
            if not eng.healthy:  # a tensor-parallel rank of this replica died
                raise eng.executor.error or EngineDeadError("engine unhealthy")
            if eng.has_unfinished():
                outs = eng.step()
                if outs:
                    self.conn.send(("out", outs))
                self.dirty = True
            elif time.monotonic() - self.last_check > 10.0:
                self.check()
            now = time.monotonic()
            if self.dirty and (not eng.has_unfinished() or now - self.last_stats >= STATS_INTERVAL_S):
                self.conn.send(("stats", self.stats()))
                self.dirty, self.last_stats = False, now

    def handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except ValueError as e:
                self.conn.send(("error", rid, e if isinstance(e, RequestError) else RequestError(str(e))))
        elif kind == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self.conn.send(("out", [out]))
        elif kind == "reset":
            self.conn.send(("reset", cmd[1], self.engine.reset_prefix_cache()))
        elif kind == "stop":
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            self.stopped = True

    def stats(self):
        from leverlab.engine.async_engine import EngineStats

        eng = self.engine
        return EngineStats(num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
                           num_free_blocks=eng.blocks.num_free, num_total_blocks=eng.blocks.num_blocks,
                           num_cached_blocks=eng.blocks.num_cached_free,
                           counters={**eng.counter_snapshot(), "integrity_errors": self.integrity_errors})

    def check(self) -> None:
        """While idle, check the KV accounting, as AsyncLLM does."""
        self.last_check = time.monotonic()
        self.integrity_errors += not self.engine.kv_accounting_ok()
