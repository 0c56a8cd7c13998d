"""Process groups and their timeouts: how idle ranks wait forever while a dead or hung peer is noticed fast.

Two groups over the same ranks:
  control  the default group, always gloo on the host. Carries rank 0's step broadcasts (and the start-up
           handshake). Timeouts are per process: after warm-up a worker's is a year (an idle worker blocks in
           the broadcast for the next step for as long as the server has no requests), rank 0's is the step
           timeout below (it only sends when it has a step; a peer that stops reading fails the send).
  compute  gloo on CPU, NCCL on CUDA. Carries the collectives inside a forward (all-reduces, the logits
           gather). After warm-up its timeout is LEVERLAB_TP_STEP_TIMEOUT_S (default 30 s): ranks enter a
           step together, so a collective that waits that long means a hung peer.
Before warm-up ends both wait a day: ranks load weights and compile at their own pace.

A peer that dies (crash, OOM kill, SIGKILL) is noticed within a second or so, not after a timeout: gloo's
sockets close and the pending collective raises at once (measured: ~1 ms after the peer's exit), and rank 0's
liveness monitor (executor.py) waits on every worker's process sentinel and marks the engine unhealthy even
while it is idle. NCCL does not see a closed socket, so on CUDA the monitor aborts the compute group.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from leverlab import env
from leverlab.distributed import comm
from leverlab.distributed.parallel_state import TPState
from leverlab.errors import TensorParallelError

RENDEZVOUS_TIMEOUT = timedelta(seconds=180)  # all ranks must have started and connected by then
STARTUP_TIMEOUT = timedelta(days=1)
IDLE_TIMEOUT = timedelta(days=365)


def step_timeout() -> timedelta:
    return timedelta(seconds=float(env.get("LEVERLAB_TP_STEP_TIMEOUT_S", "30")))


def init_groups(rank: int, size: int, addr: str, port: int, device: torch.device, dead=None,
                host_store: bool = True) -> TPState:
    """Join the ranks (rank 0 hosts torch.distributed's TCPStore on addr:port, node 0's address, unless
    host_store is False: torchrun's agent hosts it; the others connect to it, from this host or another) and
    build both groups.
    dead (rank 0): returns a message when a local worker has died, so start-up fails at once, not at the timeout."""
    store = dist.TCPStore(addr, port, size, is_master=rank == 0 and host_store, timeout=RENDEZVOUS_TIMEOUT,
                          wait_for_workers=False, multi_tenant=True)
    if rank == 0:
        keys = [f"leverlab-up-{r}" for r in range(1, size)]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while not store.check(keys):
            if dead is not None and (why := dead()):
                raise TensorParallelError(f"{why} while starting")
            if time.monotonic() > deadline:
                missing = [k.rsplit("-", 1)[1] for k in keys if not store.check([k])]
                raise TensorParallelError(f"tensor-parallel ranks {', '.join(missing)} did not join at {addr}:{port} "
                                          f"within {RENDEZVOUS_TIMEOUT} (on other hosts: were they launched?)")
            time.sleep(0.05)
    else:
        store.set(f"leverlab-up-{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = dist.new_group(list(range(size)), timeout=STARTUP_TIMEOUT, backend=backend)
    comm.GROUPS[1] = group
    return TPState(rank=rank, size=size, group=group, group_id=1)


def after_warmup(state: TPState) -> None:
    """Every rank, once warm: steps from now on are short and in lockstep; idle waits are not."""
    # Timeouts are per process: rank 0 only ever sends on the control group when it has a step, so a send
    # that cannot complete (a stopped peer) must fail fast there, while the workers' receives wait forever.
    c10d._set_pg_timeout(step_timeout() if state.rank == 0 else IDLE_TIMEOUT, None)
    c10d._set_pg_timeout(step_timeout(), state.group)


def abort(state: TPState) -> None:
    """Unblock collectives that cannot finish (a peer is gone). Best effort: gloo raises by itself."""
    try:
        c10d._abort_process_group(state.group)
    except Exception:  # noqa: BLE001 - not every backend or version can abort; the step timeout still holds
        pass


def destroy() -> None:
    comm.GROUPS.clear()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may already be gone; the process is leaving anyway
            pass
