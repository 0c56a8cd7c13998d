"""A host other than node 0 in a multi-host tensor-parallel job: it starts its share of the ranks and waits.

`leverlab serve MODEL --tensor-parallel-size 4 --nnodes 2 --node-rank 1 --master-addr HOST0 --master-port P`
(or the same under torchrun's environment) comes here instead of serving: no API, no engine, no scheduler.
It spawns one worker per local rank (worker.py, the loop every non-zero rank runs), which meet rank 0 at the
rendezvous on node 0 and then run whatever steps rank 0 broadcasts. It leaves when they do: exit 0 when
rank 0 shut them down, 1 when any failed (a collective broke: rank 0 or a peer went away). SIGTERM/SIGINT
stop the workers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal

from leverlab import env
from leverlab.config import EngineConfig, default_model_path
from leverlab.distributed.rendezvous import Rendezvous
from leverlab.models.config import ModelConfig
from leverlab.worker.tp_worker import WorkerArgs, worker_main

log = logging.getLogger("leverlab")


def run_node(config: EngineConfig, rdv: Rendezvous, aux_layers: tuple[int, ...] = ()) -> int:
    """aux_layers: EAGLE's feature layers, as rank 0's runner has them (the engine knows them: serve_node)."""
    import torch

    path = str(config.model or default_model_path())
    model_config = ModelConfig.from_folder(path)
    # The same numbers rank 0 uses: the KV-cache size itself is broadcast by rank 0 at start.
    max_len = config.max_model_len or model_config.default_max_len
    threads = config.num_threads or max(1, env.default_threads(model_config, config.dtype) // rdv.per_node)
    device = env.pick_device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < rdv.per_node:
        log.error("node %d needs %d GPUs, %d visible", rdv.node_rank, rdv.per_node, torch.cuda.device_count())
        return 2
    ctx = mp.get_context("spawn")
    procs = []
    for i, rank in enumerate(rdv.local_ranks):
        dev = f"cuda:{i}" if device.type == "cuda" else "cpu"
        args = WorkerArgs(rank, rdv.size, rdv.addr, rdv.port, config, path, max_len, threads, dev, os.getpid(),
                          aux_layers)
        p = ctx.Process(target=worker_main, args=(args,), name=f"leverlab-tp-rank{rank}")
        p.start()
        procs.append(p)
    log.info("node %d of %d: tensor-parallel ranks %s (pids %s) joining %s:%d", rdv.node_rank, rdv.nnodes,
             list(rdv.local_ranks), [p.pid for p in procs], rdv.addr, rdv.port)

    def stop(sig, _frame):
        log.info("signal %d: stopping the workers", sig)
        for p in procs:
            if p.is_alive():
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    pending = list(procs)
    while pending:  # one failure ends the node: the job cannot go on without a rank
        multiprocessing.connection.wait([p.sentinel for p in pending])
        for p in [p for p in pending if not p.is_alive()]:
            pending.remove(p)
            p.join()
            if p.exitcode != 0:
                stop(signal.SIGTERM, None)
    codes = [p.exitcode for p in procs]
    log.info("node %d: workers left with %s", rdv.node_rank, codes)
    return 0 if all(c == 0 for c in codes) else 1
