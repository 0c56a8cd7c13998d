"""The engine's bookkeeping, free of any torch model: sequences (sequence.py), the paged KV-cache block manager
with its prefix cache (block_manager.py), and the scheduler that gives each step's token budget to sequences and
hands the model runner a `ScheduledBatch` (scheduler.py).

May import the plain types (config, errors, outputs, sampling_params) only; worker, speculative and engine build
on it.
"""
