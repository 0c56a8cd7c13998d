"""Speculative decoding: the proposers (ngram, draft model, EAGLE heads and their file formats), verification,
the throughput gate, and SpecDecoder, the driver the engine's step loop uses (decoder.py). Its settings
(--speculative-config) are a plain type below everything: leverlab/speculative_config.py.

May import worker, core, models, layers, quant, kernels and the plain types; never engine.
"""
