"""Where the tensor-parallel ranks meet, and which of them this launch holds: one host or several.

torch.distributed's own rendezvous: rank 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT, every other rank
connects to it, and the process groups (gloo on CPU, NCCL on CUDA) are built over it (groups.py). Settings
come from the flags `--nnodes --node-rank --master-addr --master-port` (torchrun's and vLLM's names) or,
unset, from the environment torchrun exports (WORLD_SIZE = hosts, RANK = this host, MASTER_ADDR,
MASTER_PORT; under torchrun rank 0 joins the store torchrun's agent hosts): one launch per host, each
holding tp / nnodes consecutive ranks. Node 0 holds rank 0, the
engine, and serves the API; the other nodes only compute (worker/node.py).

On one host (nnodes 1) the store listens on a free loopback port picked at start, whatever the environment
says: several engines on one host (data-parallel replicas with TP) must not share a port.
"""

from __future__ import annotations

from dataclasses import dataclass

from leverlab import env
from leverlab.config import EngineConfig
from leverlab.errors import UnsupportedLever


@dataclass(frozen=True)
class Rendezvous:
    addr: str  # node 0's address (the TCPStore's host)
    port: int | None  # None: one host, a free loopback port is picked when the ranks start
    nnodes: int
    node_rank: int
    size: int  # tensor-parallel ranks in all
    # Under torchrun its agent on node 0 already hosts a TCPStore at MASTER_ADDR:MASTER_PORT (and says so in
    # TORCHELASTIC_USE_AGENT_STORE): then rank 0 joins it as a client instead of binding the port again.
    agent_store: bool = False

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this launch holds (node 0: rank 0, the engine, and its local workers)."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @property
    def multi_host(self) -> bool:
        return self.nnodes > 1


def _env_int(name: str) -> int | None:
    v = env.get(name, "")
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise UnsupportedLever(f"${name} must be an integer, got {v!r}") from None


def resolve(config: EngineConfig) -> Rendezvous:
    """Flags first, then torchrun's environment; refuses (with the numbers) a split that cannot work."""
    size = config.tensor_parallel_size
    use_env = size > 1  # a lone engine ignores a WORLD_SIZE meant for something else
    nnodes = config.nnodes or (_env_int("WORLD_SIZE") if use_env else None) or 1
    node_rank = config.node_rank if config.node_rank is not None else (_env_int("RANK") if use_env else None) or 0
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UnsupportedLever(f"--node-rank must be in [0, --nnodes): got node rank {node_rank} of {nnodes}")
    if nnodes == 1:
        return Rendezvous("127.0.0.1", None, 1, 0, size)
    if size % nnodes:
        raise UnsupportedLever(f"--tensor-parallel-size {size} does not split over --nnodes {nnodes}: each host "
                               "holds the same number of ranks")
    addr = config.master_addr or env.get("MASTER_ADDR", "") or "127.0.0.1"
    port = config.master_port or _env_int("MASTER_PORT")
    if not port:
        raise UnsupportedLever("--nnodes > 1 needs --master-port (or $MASTER_PORT): the port on node 0 where "
                               "the ranks meet")
    return Rendezvous(addr, port, nnodes, node_rank, size,
                      agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True")
