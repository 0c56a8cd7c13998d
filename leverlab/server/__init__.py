"""The OpenAI-compatible HTTP server (`leverlab serve`).

One job per file, in the order a request meets them:
    cli.py        flags (vLLM's names) -> EngineConfig; uvicorn; SIGTERM drain
    app.py        the FastAPI app: routes, the ASGI gate (drain + API key), disconnect handling
    auth.py       the optional bearer key
    protocol.py   request bodies (pydantic, strict) -> SamplingParams; refuses what is not built
    inputs.py     prompts -> token ids (chat template), context-length checks with both numbers
    streaming.py  server-sent events: per-choice diffs of the engine's cumulative outputs
    responses.py  response objects: choices, logprobs, usage, the `timings` extension field
    errors.py     every failure as an OpenAI-shaped error with the right status
    metrics.py    Prometheus: request histograms, engine gauges and counters read at scrape time
"""
