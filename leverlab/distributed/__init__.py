"""Tensor parallelism's transport: one process per rank, torch.distributed underneath. It moves tensors and runs
no model: the executors and the ranks' loop that run the model over it live in worker/.

parallel_state.py  who this process is (rank, size, groups) and how heads / vocab / MLP split
comm.py            the collectives the model calls (an all-reduce custom op, the logits gather) and their timers
groups.py          the process groups, with timeouts
rendezvous.py      where the ranks meet (flags or torchrun's environment)
protocol.py        one step's inputs as two int64 tensors, broadcast from rank 0 (the step wire format)
docs/tensor-parallel.md explains the design.

May import kernels (the all-reduce custom op) and the plain types; never layers, models, worker or engine.
"""
