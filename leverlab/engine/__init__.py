"""The engine: the step loop (llm_engine.py: schedule, run the model, sample, hand out what changed), requests and
their detokenization, the asyncio face (async_engine.AsyncLLM), data-parallel replicas and their router, and the
EngineClient protocol the server codes against (client.py).

May import speculative, worker, core, models, distributed and the plain types; never server or the tools.
"""
