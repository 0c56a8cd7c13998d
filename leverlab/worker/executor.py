"""Executors: what runs the engine's model steps. `LocalExecutor`, one process; `TPExecutor`, tensor parallel.

Both offer the engine the same few members (runner, healthy, error, procs, counters(), close()), so the step loop
has no tensor-parallel branches; `make_executor` picks one from the config.

TPExecutor is rank 0's side of tensor parallelism: start one worker process per other rank, keep them in step,
watch them.

Rank 0 is the engine's own process: it schedules, owns the only block manager, samples and detokenizes.
Its model runner (Rank0Runner) is a ModelRunner over rank 0's slice of the model whose every step first
broadcasts the step's inputs to the workers (protocol.py), then runs the forward in which all ranks meet
in the all-reduces. Any failure inside a step (a dead or hung rank, or ranks out of step) breaks the
executor for good: the step raises TensorParallelError and `healthy` turns False, so the server answers
in-flight requests with an error and /health with 503 instead of hanging (groups.py: the timeouts).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from leverlab import env
from leverlab.config import EngineConfig
from leverlab.distributed import comm, groups, protocol
from leverlab.distributed.parallel_state import check_model
from leverlab.distributed.rendezvous import Rendezvous, resolve
from leverlab.errors import TensorParallelError, UnsupportedLever
from leverlab.models.config import ModelConfig
from leverlab.worker.model_runner import ModelRunner
from leverlab.worker.tp_worker import WorkerArgs, worker_main

log = logging.getLogger("leverlab")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank0Runner(ModelRunner):
    """The engine's ModelRunner at TP > 1: rank 0's slice; each step is sent to the workers first."""

    def __init__(self, executor: TPExecutor, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.executor = executor
        self.step_hook = executor.send_step

    def warmup(self) -> None:
        with self.executor.guard("warm-up"):
            super().warmup()
        groups.after_warmup(self.tp)
        comm.STATS.reset()  # warm-up waited for the workers to load: not communication time

    def execute(self, batch):
        with self.executor.guard("a step"):
            out = super().execute(batch)
        comm.STATS.settle()  # the logits' .cpu() synchronized the device
        return out


class LocalExecutor:
    """One process, one rank: the runner runs every step itself; nothing to watch or stop."""

    error: TensorParallelError | None = None
    procs: tuple = ()  # no worker processes

    def __init__(self, config: EngineConfig, model_path: str, max_model_len: int, aux_layers: tuple[int, ...] = ()):
        self.runner = ModelRunner(config, model_path, max_model_len, aux_layers=aux_layers)

    @property
    def healthy(self) -> bool:
        return True

    def counters(self) -> dict[str, float]:
        return self.runner.counters()

    def close(self) -> None:
        pass


def make_executor(config: EngineConfig, model_path: str, max_model_len: int, threads: int,
                  rdv: Rendezvous | None, aux_layers: tuple[int, ...] = ()) -> LocalExecutor | TPExecutor:
    """The executor the config asks for: tensor parallel at --tensor-parallel-size > 1, else one process."""
    if config.tensor_parallel_size > 1:
        return TPExecutor(config, model_path, max_model_len, threads, rdv, aux_layers)
    return LocalExecutor(config, model_path, max_model_len, aux_layers)


class TPExecutor:
    def __init__(self, config: EngineConfig, model_path: str, max_model_len: int, threads: int,
                 rdv: Rendezvous | None = None, aux_layers: tuple[int, ...] = ()):
        size = config.tensor_parallel_size
        rdv = rdv or resolve(config)
        device = env.pick_device(config.device)
        local = rdv.per_node  # ranks on this host: 0 .. local-1 (other hosts start theirs: worker/node.py)
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise UnsupportedLever(f"--tensor-parallel-size {size} over {rdv.nnodes} host(s) needs {local} GPUs "
                                   f"per host; {torch.cuda.device_count()} visible")
        check_model(ModelConfig.from_folder(model_path), size)  # before any process starts
        if dist.is_initialized():
            raise UnsupportedLever("a tensor-parallel engine is already running in this process; close it first "
                                   "(LLMEngine.close())")
        self.size, self.device = size, device
        self.error: TensorParallelError | None = None
        self.steps = 0
        self.broadcast_seconds = 0.0
        self._closed = False
        port = rdv.port or _free_port()
        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of a process with threads and torch state
        self.procs = []
        for rank in range(1, local):
            dev = f"cuda:{rank}" if device.type == "cuda" else "cpu"
            args = WorkerArgs(rank, size, rdv.addr, port, config, model_path, max_model_len, threads, dev,
                              os.getpid(), aux_layers)
            p = ctx.Process(target=worker_main, args=(args,), name=f"leverlab-tp-rank{rank}")
            p.start()
            self.procs.append(p)
        atexit.register(self.close)
        self._monitor = threading.Thread(target=self._watch, name="leverlab-tp-monitor", daemon=True)
        self._monitor.start()
        try:
            self.state = groups.init_groups(0, size, rdv.addr, port, device, dead=self._dead_worker,
                                            host_store=not rdv.agent_store)
            self.runner = Rank0Runner(self, config, model_path, max_model_len, tp=self.state, device=device,
                                      aux_layers=aux_layers)
            dist.broadcast(torch.tensor([self.runner.num_blocks], dtype=torch.int64), 0)  # the workers' KV size
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks on %d host(s) (%s, %d threads each), local worker pids %s", size,
                 rdv.nnodes, device.type, threads, [p.pid for p in self.procs])

    # ---- liveness ---------------------------------------------------------------------------------
    def _dead_worker(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                return f"tensor-parallel rank {rank} (pid {p.pid}) died ({how})"
        return None

    def _watch(self) -> None:
        """Wait on the workers' process sentinels; a death breaks the executor at once, even when idle.
        (Ranks on other hosts are not processes of ours: their death fails the next collective instead.)"""
        if not self.procs:
            return
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closed:
            return
        time.sleep(0.05)  # let exit codes settle
        what = self._dead_worker() or "a tensor-parallel worker exited"
        log.error("%s: the engine cannot continue", what)
        if self.error is None:
            self.error = TensorParallelError(f"{what}; the engine cannot continue: restart it")
        if self.state_ready and self.device.type == "cuda":
            groups.abort(self.state)  # NCCL would wait for the dead peer; gloo already raised

    @property
    def state_ready(self) -> bool:
        return hasattr(self, "state")

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closed and all(p.is_alive() for p in self.procs)

    @contextmanager
    def guard(self, what: str):
        """Run a step (or warm-up); any failure becomes a TensorParallelError that names the cause."""
        if self.error is not None:
            raise self.error
        try:
            yield
        except Exception as e:
            self.error = self._diagnose(e, what)
            raise self.error from e

    def _diagnose(self, e: Exception, what: str) -> TensorParallelError:
        deadline = time.monotonic() + 3.0  # gloo can raise before the dead process's exit code is visible
        dead = self._dead_worker()
        while dead is None and time.monotonic() < deadline and _looks_distributed(e):
            time.sleep(0.05)
            dead = self._dead_worker()
        if dead:
            return TensorParallelError(f"{dead} during {what}; the engine cannot continue: restart it")
        if _looks_distributed(e):
            return TensorParallelError(f"a tensor-parallel collective failed during {what} (a rank hung or is "
                                       f"unreachable): {e}; the engine cannot continue: restart it")
        return TensorParallelError(f"rank 0 failed during {what}, leaving the ranks out of step: {e!r}; "
                                   "the engine cannot continue: restart it")

    # ---- steps --------------------------------------------------------------------------------------
    def send_step(self, ids, positions, slots, tables, seq_lens, starts, rows) -> None:
        header, payload = protocol.pack(ids, positions, slots, tables, seq_lens, starts, rows)
        t0 = time.perf_counter()
        dist.broadcast(header, 0)
        dist.broadcast(payload, 0)
        self.broadcast_seconds += time.perf_counter() - t0
        self.steps += 1

    def counters(self) -> dict[str, float]:
        """Engine counters (exported as leverlab_engine_<name>_total): time in communication on rank 0."""
        s = comm.STATS
        return {"tp_steps": self.steps, "tp_allreduce_seconds": s.allreduce_seconds, "tp_allreduces": s.allreduces,
                "tp_gather_seconds": s.gather_seconds, "tp_broadcast_seconds": self.broadcast_seconds,
                **self.runner.counters()}  # rank 0's share of the weights (MoE reads: its slice)

    def close(self) -> None:
        """Tell the workers to leave, wait briefly, kill what remains, drop the groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.error is None and self.state_ready and all(p.is_alive() for p in self.procs):
            try:
                dist.broadcast(torch.tensor([protocol.SHUTDOWN] + [0] * (protocol.HEADER_LEN - 1)), 0)
            except Exception:  # noqa: BLE001 - a worker may have died meanwhile; it is killed below
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        groups.destroy()
        atexit.unregister(self.close)


def _looks_distributed(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "timed out",
                                                                     "timeout", "peer", "closed"))
