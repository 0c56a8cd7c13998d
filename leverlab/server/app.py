"""The FastAPI app: routes of the OpenAI API plus /health, /metrics, /version.

`build_app(engine, args)` serves any object that keeps AsyncLLM's contract (leverlab/engine/async_engine.py).
The engine's step loop runs on its own thread; handlers only await its async streams, so the event loop
never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict, is_dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

import leverlab
from leverlab.engine.client import EngineClient, EnginePrompt
from leverlab.errors import EngineDeadError
from leverlab.outputs import RequestOutput
from leverlab.server import auth, tokens_api
from leverlab.server import responses as R
from leverlab.server.admission import Admission, Ticket
from leverlab.server.body import BodyParser
from leverlab.server.errors import error_response, install_handlers
from leverlab.server.gate import Gate
from leverlab.server.gen_config import SamplingDefaults
from leverlab.server.inputs import checked, default_max_tokens, encode_chat, encode_prompt, limits
from leverlab.server.metrics import CONTENT_TYPE, ServerMetrics
from leverlab.server.protocol import ChatCompletionRequest, CompletionRequest
from leverlab.server.reasoning import ReasoningParser
from leverlab.server.state import (
    MAX_BODY_BYTES,
    MAX_INFLIGHT_BODY_BYTES,
    STREAM_STALL_TIMEOUT_S,
    WORKER_THREADS,
    ClientGone,
    ServerState,
    check_logprobs,
    check_model,
    off_loop,
    read_request,
    rejected,
)
from leverlab.server.streaming import GuardedStreamingResponse, StreamContext, event_stream, merge
from leverlab.server.templates import TemplatePolicy, load_chat_template
from leverlab.server.tools import plan_tools

log = logging.getLogger("leverlab.server")

def _model_path(engine: EngineClient) -> str | None:
    """The model folder the engine serves, as configured (None where the engine has no config)."""
    return engine.config.model if engine.config is not None else None


def _served_names(args: Any, engine: Any) -> list[str]:
    names = getattr(args, "served_model_name", None)
    if isinstance(names, str):
        names = [names]
    return list(names) if names else [engine.model_name]


def build_app(engine: EngineClient, args: Any = None) -> FastAPI:
    """The app serving `engine`. args (all optional): served_model_name (str or list), api_key (None: open),
    chat_template, trust_request_chat_template, generation_config, max_logprobs, disable_log_requests,
    allowed_origins, stream_stall_timeout."""
    names = _served_names(args, engine)
    opt = lambda name, default=None: getattr(args, name, None) if getattr(args, name, None) is not None else default  # noqa: E731
    pool = concurrent.futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="leverlab-server")
    state = ServerState(
        engine=engine,
        served_names=names,
        api_key=auth.resolve_api_key(getattr(args, "api_key", None)),
        metrics=ServerMetrics(engine, names[0]),
        token_text=R.TokenText(engine.tokenizer),
        admission=Admission(int(engine.capacity_seqs), MAX_INFLIGHT_BODY_BYTES, MAX_BODY_BYTES),
        limits=limits(engine),
        pool=pool,
        parser=BodyParser(pool),
        templates=TemplatePolicy(load_chat_template(opt("chat_template")), bool(opt("trust_request_chat_template"))),
        defaults=SamplingDefaults.from_model(_model_path(engine),
                                             opt("generation_config", "auto")),
        max_logprobs=int(opt("max_logprobs", 20)),
        reasoning=ReasoningParser(opt("reasoning_parser")) if opt("reasoning_parser") else None,
        log_requests=not opt("disable_log_requests", False),
        allowed_origins=tuple(opt("allowed_origins", ())),
        stall_timeout_s=float(opt("stream_stall_timeout", STREAM_STALL_TIMEOUT_S)),
        enable_auto_tool_choice=bool(opt("enable_auto_tool_choice", False)),
        tool_call_parser=opt("tool_call_parser"),
    )
    app = FastAPI(
        title="LeverLab", version=leverlab.__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = state
    install_handlers(app)
    app.add_middleware(Gate, state=state)
    if state.allowed_origins:  # CORS only when the operator names origins; none by default
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    _add_routes(app, state)
    tokens_api.add_routes(app, state)
    return app


def _add_routes(app: FastAPI, st: ServerState) -> None:
    engine = st.engine

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:  # replicas add each one's state; degraded once some left (the others serve)
            return R.OpenAIJSON({"status": "degraded" if engine.degraded else "ok", **engine.health()})
        return error_response(503, "the engine is not running")

    @app.get("/version")
    async def version() -> Response:
        cfg = engine.config
        return R.OpenAIJSON(
            {
                "version": leverlab.__version__,
                "model": st.model_name,
                "max_model_len": engine.max_model_len,
                "config": asdict(cfg) if is_dataclass(cfg) else None,
            }
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Admin (under the API key): forget cached prefix blocks nobody uses, so a benchmark starts cold."""
        n = await engine.reset_prefix_cache()
        return R.OpenAIJSON({"status": "ok", "blocks_reset": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": st.created,
                "owned_by": "leverlab",
                "root": str(_model_path(engine) or name),
                "max_model_len": engine.max_model_len,
            }
            for name in st.served_names
        ]
        return R.OpenAIJSON({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        ticket: Ticket | None = None
        try:
            req = await read_request(request, st, CompletionRequest)
            check_model(st, req.model)
            st.defaults.apply(req)
            # parameter errors first, before tokenizing (max_tokens is only known after, when null)
            requested = req.engine_max_tokens()
            probe = req.sampling_params(requested if requested is not None else max(1, req.min_tokens))
            check_logprobs(st, probe.logprobs, probe.prompt_logprobs)
            raw_prompts = req.prompts()
            ticket = st.admission.reserve_seqs(len(raw_prompts), probe.n)  # before any tokenizing
            prompts = await off_loop(st, _encode_all, engine, raw_prompts, size=sum(map(len, raw_prompts)))
            # each prompt of a batch gets its own room in the context, as in vLLM
            per_prompt = [req.sampling_params(default_max_tokens(requested, len(p.token_ids), engine.max_model_len,
                                                                 default=st.defaults.max_tokens)) for p in prompts]
            params = per_prompt[0]
            engine_prompts = [checked(engine, p, pp.max_tokens) for p, pp in zip(prompts, per_prompt)]
        except Exception as e:
            if ticket is not None:
                ticket.release()
            return rejected(st, e)
        echo = (
            [p.text if p.text is not None else engine.tokenizer.decode(p.token_ids) for p in prompts]
            if req.echo
            else None
        )
        ctx = StreamContext(
            request_id=R.new_id("cmpl"),
            created=R.now(),
            model=req.model or st.model_name,
            chat=False,
            logprobs_k=params.logprobs,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=_continuous_usage(req),
            n=params.n,
            token_text=R.TokenIdText() if req.return_tokens_as_token_ids else st.token_text,
            tokenize_s=[p.tokenize_s for p in prompts],
            echo=echo,
            echo_only=req.echo_only,
            asked_prompt_logprobs=req.prompt_logprobs is not None,
            prompt_logprobs_k=params.prompt_logprobs,
            return_token_ids=req.return_token_ids,
        )
        return await _serve(request, st, ctx, engine_prompts, per_prompt, req.stream, ticket)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        ticket: Ticket | None = None
        try:
            req = await read_request(request, st, ChatCompletionRequest)
            check_model(st, req.model)
            st.defaults.apply(req)
            # parameter errors first, before the template runs (max_tokens may need the prompt's length)
            requested = req.requested_max_tokens()
            tools = plan_tools(req.tools, req.tool_choice, st.enable_auto_tool_choice, st.tool_call_parser,
                               req.parallel_tool_calls)
            schema = tools.schema() if tools is not None else None
            probe = req.sampling_params(requested if requested is not None else max(1, req.min_tokens), schema)
            check_logprobs(st, probe.logprobs, probe.prompt_logprobs)
            template = st.templates.template_for(req)
            ticket = st.admission.reserve_seqs(1, probe.n)
            # Templates always render on a worker thread: even the server's own can be slow on a long chat.
            prompt = await asyncio.get_running_loop().run_in_executor(st.pool, encode_chat, engine, req, template)
            max_tokens = default_max_tokens(
                req.requested_max_tokens(), len(prompt.token_ids), engine.max_model_len,
                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                default=st.defaults.max_tokens,
            )
            params = req.sampling_params(max_tokens, schema)
            engine_prompt = checked(engine, prompt, max_tokens)
        except Exception as e:
            if ticket is not None:
                ticket.release()
            return rejected(st, e)
        ctx = StreamContext(
            request_id=R.new_id("chatcmpl"),
            created=R.now(),
            model=req.model or st.model_name,
            chat=True,
            logprobs_k=params.logprobs,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=_continuous_usage(req),
            n=params.n,
            token_text=st.token_text,
            tokenize_s=[prompt.tokenize_s],
            prompt_logprobs_k=params.prompt_logprobs,
            return_token_ids=req.return_token_ids,
            reasoning=st.reasoning.for_request(req.chat_template_kwargs) if st.reasoning else None,
            include_reasoning=req.include_reasoning,
            tools=tools,
        )
        return await _serve(request, st, ctx, [engine_prompt], [params], req.stream, ticket)


def _continuous_usage(req: Any) -> bool:
    """vLLM's rule: continuous_usage_stats counts only together with include_usage."""
    so = req.stream_options
    return bool(so and so.include_usage and so.continuous_usage_stats)


def _encode_all(engine: Any, prompts: list[str | list[int]]) -> list:
    return [encode_prompt(engine, p) for p in prompts]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, aw: Awaitable, stopped: asyncio.Event) -> Any:
    """Await `aw`, cancelling it (which aborts the engine request) if the client disconnects meanwhile,
    or if the server finishes draining first (then EngineDeadError: 503)."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({work, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        for f in (watch, stop):
            f.cancel()
        await asyncio.gather(watch, stop, return_exceptions=True)
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        if stopped.is_set():
            raise EngineDeadError("the server shut down before this request finished")
        raise ClientGone()
    return work.result()


async def _serve(
    request: Request, st: ServerState, ctx: StreamContext, prompts: list[EnginePrompt], per_prompt: list[Any],
    stream: bool, ticket: Ticket,
) -> Response:
    """Run the admitted request (`per_prompt`: each prompt's SamplingParams, which differ only in max_tokens);
    `ticket` (its sequences) is released when the response is done, whatever way it ends."""
    engine = st.engine
    params = per_prompt[0]
    ids = [ctx.request_id] if len(prompts) == 1 else [f"{ctx.request_id}-{i}" for i in range(len(prompts))]
    if st.log_requests:
        log.info("request %s: %d prompt(s), %s prompt tokens, n=%d, max_tokens=%d, stream=%s", ctx.request_id,
                 len(prompts), "+".join(str(len(p.token_ids)) for p in prompts), params.n, params.max_tokens,
                 stream)
    handed_off = False
    try:
        streams = [engine.generate(p, pp, rid) for p, pp, rid in zip(prompts, per_prompt, ids)]
        merged = merge(streams)
        tok_s = ctx.tokenize_s
        ctx.on_aborted = st.metrics.aborted.inc
        ctx.stop = st.stopped
        ctx.draining = lambda: st.draining
        ctx.on_finished = lambda out: st.metrics.observe_finished(out, tok_s[_prompt_index(ids, out.request_id)])
        try:
            if stream:
                # Wait for the first output before sending headers: admission errors (overload, too long)
                # become a proper status code, and the first chunk the client sees holds the first token.
                first = await _unless_disconnected(request, anext(merged), st.stopped)
            else:
                finals = await _unless_disconnected(request, _collect(merged, len(prompts), ctx), st.stopped)
        except ClientGone:
            st.metrics.aborted.inc()
            await merged.aclose()
            return Response(status_code=499)
        except StopAsyncIteration:
            return error_response(500, "the engine produced no output")
        except Exception as e:
            await merged.aclose()
            return rejected(st, e)
        if stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            ctx.on_done = ticket.release
            handed_off = True

            def stalled() -> None:
                st.metrics.rejected.labels(reason="stream_stalled").inc()
                log.warning("stream %s: the client took no data for %.0f s; aborted (its KV blocks are freed)",
                            ctx.request_id, st.stall_timeout_s)

            return GuardedStreamingResponse(
                event_stream(ctx, first, merged, len(prompts)), stall_timeout_s=st.stall_timeout_s,
                on_stall=stalled, media_type="text/event-stream", headers=headers,
            )
        # Building a big response (prompt_logprobs, logprobs of many choices) takes a while: off the loop.
        big = params.prompt_logprobs is not None or params.logprobs is not None or params.n * len(prompts) > 8
        if big:
            body = await asyncio.get_running_loop().run_in_executor(st.pool, _render_full, ctx, finals)
            return Response(body, media_type="application/json")
        return R.OpenAIJSON(_full_response(ctx, finals))
    except Exception as e:
        return rejected(st, e)
    finally:
        if not handed_off:
            ticket.release()


def _render_full(ctx: StreamContext, finals: list[RequestOutput]) -> bytes:
    """_full_response as JSON bytes, on a worker thread, encoded piece by piece (responses.dumps_in_pieces)."""
    return R.dumps_in_pieces(_full_response(ctx, finals))


def _prompt_index(ids: list[str], request_id: str) -> int:
    try:
        return ids.index(request_id)
    except ValueError:
        return 0


async def _collect(
    merged: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int, ctx: StreamContext
) -> list[RequestOutput]:
    last: dict[int, RequestOutput] = {}
    try:
        async for p, out in merged:
            last[p] = out
            if out.finished and ctx.on_finished is not None:
                ctx.on_finished(out)
            if len(last) == num_prompts and all(o.finished for o in last.values()):
                break
    finally:
        await merged.aclose()
    if len(last) < num_prompts or not all(o.finished for o in last.values()):
        raise EngineDeadError("the engine ended a request's stream before it finished")
    return [last[i] for i in range(num_prompts)]


def _full_response(ctx: StreamContext, finals: list[RequestOutput]) -> dict[str, Any]:
    tt, k = ctx.token_text, ctx.logprobs_k
    if ctx.chat:
        choices = [R.chat_choice(tt, c, k, ctx.return_token_ids, ctx.reasoning, ctx.include_reasoning)
                   for c in finals[0].outputs]
        if ctx.tools is not None:  # tool calls parsed out of the content (server/tools.py)
            for ch, c in zip(choices, finals[0].outputs):
                msg, ch["finish_reason"] = ctx.tools.message(ch["message"].get("content") or "", c.finish_reason)
                if "tool_calls" in msg:
                    ch["message"].update(msg)
    else:
        choices = [
            R.completion_choice(tt, c, p * ctx.n + c.index, k, prefix=ctx.echo[p] if ctx.echo else "",
                                prompt=out, prompt_k=ctx.prompt_logprobs_k, token_ids=ctx.return_token_ids,
                                echo=ctx.echo is not None, echo_only=ctx.echo_only,
                                asked_prompt_logprobs=ctx.asked_prompt_logprobs)
            for p, out in enumerate(finals)
            for c in out.outputs
        ]
    body = {
        "id": ctx.request_id,
        "object": "chat.completion" if ctx.chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": R.usage(finals),
        "system_fingerprint": R.SYSTEM_FINGERPRINT,
    }
    if ctx.chat:  # vLLM's chat extensions sit beside the choices (one prompt), always present, null unless asked
        out = finals[0]
        with_lp = ctx.prompt_logprobs_k is not None
        body["prompt_logprobs"] = R.prompt_logprobs(tt, out, ctx.prompt_logprobs_k) if with_lp else None
        body["prompt_token_ids"] = out.prompt_token_ids if ctx.return_token_ids or with_lp else None
    body["timings"] = R.batch_timings(finals, ctx.tokenize_s)
    return body
