"""What runs the model for the engine: the model runner (a ScheduledBatch in, logits out; owns the weights and
the KV-cache tensors), the sampler and the logits controls it applies (logits_processors.py), the compiled path, and the executors: one process (LocalExecutor) or tensor
parallel (TPExecutor on rank 0, tp_worker.py on the other ranks, node.py on the other hosts).

May import core, models, layers, quant, distributed, kernels and the plain types; never speculative or engine
(what they need of it, such as EAGLE's aux layers, they pass in).
"""
