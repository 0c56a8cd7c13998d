"""Tensor parallelism (issue 9): one process per rank, torch.distributed underneath.

parallel_state.py  who this process is (rank, size, groups) and how heads / vocab / MLP split
comm.py            the collectives the model calls (an all-reduce custom op, the logits gather) and their timers
protocol.py        one step's inputs as two int64 tensors, broadcast from rank 0
worker.py          the loop of ranks 1..N-1: receive a step, run the same forward, repeat
executor.py        rank 0's side: start the workers, watch them, hand each step to them, report failures
docs/tensor-parallel.md explains the design.
"""
