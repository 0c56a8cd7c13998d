"""Where tensor-parallel ranks meet (distributed/rendezvous.py): flags first, then torchrun's environment, and
clear refusals of a split that cannot work."""

from __future__ import annotations

import pytest

from leverlab.config import EngineConfig
from leverlab.distributed.rendezvous import resolve
from leverlab.errors import UnsupportedLever

TORCHRUN = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in TORCHRUN:
        monkeypatch.delenv(k, raising=False)


def test_one_host_takes_a_free_loopback_port_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    r = resolve(EngineConfig(tensor_parallel_size=2))
    assert (r.addr, r.port, r.nnodes, r.node_rank, list(r.local_ranks)) == ("127.0.0.1", None, 1, 0, [0, 1])
    monkeypatch.setenv("WORLD_SIZE", "4")  # meant for something else: a lone engine ignores it
    assert resolve(EngineConfig()).nnodes == 1


def test_flags_split_the_ranks_over_the_hosts():
    r = resolve(EngineConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                             master_port=29500))
    assert (r.addr, r.port, r.per_node, list(r.local_ranks), r.agent_store) == ("10.0.0.1", 29500, 2, [2, 3], False)


def test_torchruns_environment(monkeypatch):
    for k, v in (("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "10.0.0.2"), ("MASTER_PORT", "29400"),
                 ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(k, v)
    r = resolve(EngineConfig(tensor_parallel_size=2))
    assert (r.addr, r.port, r.nnodes, r.node_rank, list(r.local_ranks), r.agent_store) == (
        "10.0.0.2", 29400, 2, 1, [1], True)
    assert resolve(EngineConfig(tensor_parallel_size=2, node_rank=0)).node_rank == 0  # a flag wins


def test_refusals(monkeypatch):
    with pytest.raises(UnsupportedLever, match="does not split over --nnodes 2"):
        resolve(EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=1))
    with pytest.raises(UnsupportedLever, match="needs --master-port"):
        resolve(EngineConfig(tensor_parallel_size=2, nnodes=2))
    with pytest.raises(UnsupportedLever, match=r"--node-rank must be in \[0, --nnodes\)"):
        resolve(EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(UnsupportedLever, match=r"\$WORLD_SIZE must be an integer"):
        resolve(EngineConfig(tensor_parallel_size=2))
