"""The OpenAI-compatible HTTP server (`leverlab serve`).

One job per file, in the order a request meets them:
    cli.py        flags (vLLM's names) -> EngineConfig; uvicorn; SIGTERM drain; exit 1 when the engine dies
    app.py        the FastAPI app: routes, disconnects, the response of a finished request
    gate.py       the ASGI gate in front of every route: drain, JSON only, Origin, API key
    state.py      what every route shares: ServerState, limits, reading a request, errors counted
    auth.py       the optional bearer key
    admission.py  what the server takes on, before it works on it: body bytes, sequences (prompts x n)
    body.py       bodies read and parsed off the event loop (a thread, or a parser process when big)
    protocol.py   request bodies (pydantic, strict) -> SamplingParams; refuses what is not built
    fields.py     the request fields not declared there: refused (named), or accepted because they ask nothing
    templates.py  which chat template renders a chat (--chat-template, --trust-request-chat-template)
    gen_config.py --generation-config: sampling defaults from the model's generation_config.json
    inputs.py     prompts -> token ids (chat template), checked once into the engine's EnginePrompt
    tokens_api.py vLLM's /tokenize and /detokenize
    streaming.py  server-sent events: per-choice diffs of the engine's cumulative outputs; stalled readers
    responses.py  response objects: choices, logprobs, usage, the `timings` extension field
    reasoning.py  --reasoning-parser: <think> text split into reasoning_content, streamed or not
    errors.py     every failure as an OpenAI-shaped error with the right status
    metrics.py    Prometheus: request histograms, engine gauges and counters read at scrape time

The HTTP side (everything but cli.py) sees the engine through engine.client.EngineClient only, and imports the
plain types; cli.py, which builds the engine for `leverlab serve`, may import engine and what it needs below.
"""
