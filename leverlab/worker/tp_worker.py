"""Ranks 1..N-1: a process that holds its slice of the model and KV cache and runs whatever step rank 0 sends.

It never schedules, samples or tokenizes: each step's token ids, positions, cache slots and block tables
come from rank 0 (protocol.py); it runs the same forward, joining the all-reduces, and sends its logits
slice to rank 0 in the output head's gather. It leaves when rank 0 says so, when rank 0's process is gone
(a watchdog thread: no orphans), or when a collective fails (rank 0 then reports it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leverlab.config import EngineConfig
from leverlab.distributed import groups, protocol
from leverlab.layers.attention import AttentionMetadata, max_query_len_of
from leverlab.worker.model_runner import ModelRunner
from leverlab.worker.parent_watch import exit_with_parent

log = logging.getLogger("leverlab")


@dataclass
class WorkerArgs:
    rank: int
    size: int
    addr: str  # node 0's address and the rendezvous port there (rendezvous.py)
    port: int
    config: EngineConfig
    model_path: str
    max_model_len: int
    threads: int
    device: str  # "cpu" or "cuda:<local index>"
    parent_pid: int
    aux_layers: tuple[int, ...] = ()  # EAGLE's feature layers (ModelRunner)


def worker_main(args: WorkerArgs) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")
    exit_with_parent(args.parent_pid, "leverlab-tp-parent-watch")  # rank 0 killed without a word: leave too
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        state = groups.init_groups(args.rank, args.size, args.addr, args.port, device)
        # Rank 0 sized the KV cache (its block manager hands out blocks for every rank): take its count.
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0)
        config = dataclasses.replace(args.config, num_kv_blocks=int(n))
        runner = ModelRunner(config, args.model_path, args.max_model_len, tp=state, device=device,
                             aux_layers=args.aux_layers)
        runner.warmup()  # in lockstep with rank 0's warm-up: the same forwards, the same collectives
        groups.after_warmup(state)
        log.info("tensor-parallel rank %d/%d ready (%d threads, %d KV blocks)", args.rank, args.size,
                 args.threads, runner.num_blocks)
        serve(runner, device)
    except Exception:  # noqa: BLE001 - whatever it was, rank 0 must see this rank go (its monitor does)
        log.exception("tensor-parallel rank %d failed", args.rank)
        sys.stdout.flush()
        os._exit(1)
    groups.destroy()


@torch.inference_mode()
def serve(runner: ModelRunner, device: torch.device) -> None:
    header = torch.zeros(protocol.HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0)  # idle here between steps, for as long as it takes (control group)
        if int(header[0]) == protocol.SHUTDOWN:
            return
        payload = torch.empty(protocol.payload_len(header), dtype=torch.int64)
        dist.broadcast(payload, 0)
        run_step(runner, protocol.unpack(header, payload, device))


def run_step(runner: ModelRunner, step: protocol.StepInputs) -> None:
    """Rank 0's step on this rank's slice: the runner's one forward entry with rank 0's inputs; logits go to
    rank 0 in the head's gather."""
    qsl = step.query_start_loc
    meta = AttentionMetadata(step.slots, step.block_tables, step.seq_lens, qsl, max_query_len_of(qsl))
    hidden, _ = runner.forward_step(step.ids, step.positions, meta)
    if step.rows.numel():
        runner.model.compute_logits(hidden[step.rows])
