"""AsyncLLM: the engine's step loop on a background thread, with an asyncio face for the server.

CONTRACT (the server codes against this; the implementation lands with the engine core):

    engine = AsyncLLM(EngineConfig(model=path, ...))    # loads the model, starts the step-loop thread
    engine.tokenizer          # Hugging Face tokenizer (has .apply_chat_template, .chat_template)
    engine.model_name         # the model folder's name
    engine.max_model_len      # prompt tokens + max_tokens must fit in this
    engine.config             # the EngineConfig (lever settings, for /version and bench manifests)

    async for out in engine.generate(prompt, params, request_id):   # prompt: str or list[int]
        ...   # out: RequestOutput; out.outputs has params.n CompletionOutputs (index 0..n-1),
              # each cumulative (text/token_ids only grow); out.finished on the last one.
    # generate raises, before yielding anything:
    #   RequestError      bad request (empty prompt, prompt + max_tokens > max_model_len with both numbers,
    #                     token id out of vocabulary, ...): HTTP 400
    #   EngineOverloaded  waiting queue full: HTTP 503 + Retry-After
    #   EngineDeadError   the loop died: HTTP 503
    # If the consumer stops iterating (client disconnect -> aclose()/CancelledError), the request is aborted
    # and its KV blocks are freed.

    engine.abort(request_id)
    engine.stats() -> EngineStats   # running/waiting counts, KV blocks, counters for Prometheus
    engine.healthy -> bool
    await engine.shutdown(drain_timeout_s)   # stop admitting, let running requests finish, stop the loop
"""
