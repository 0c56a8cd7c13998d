"""The FastAPI app: routes of the OpenAI API plus /health, /metrics, /version.

`build_app(engine, args)` serves any object that keeps AsyncLLM's contract (leverlab/engine/async_engine.py).
The engine's step loop runs on its own thread; handlers only await its async streams, so the event loop
never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

import leverlab
from leverlab.errors import EngineDeadError
from leverlab.outputs import RequestOutput
from leverlab.server import auth
from leverlab.server import responses as R
from leverlab.server.errors import error_response, exception_response, install_handlers
from leverlab.server.inputs import (
    Prompt,
    check_fits,
    check_token_ids,
    default_max_tokens,
    encode_chat,
    encode_prompt,
)
from leverlab.server.metrics import CONTENT_TYPE, ServerMetrics
from leverlab.server.protocol import BadRequest, ChatCompletionRequest, CompletionRequest
from leverlab.server.streaming import StreamContext, event_stream, merge

log = logging.getLogger("leverlab.server")

MAX_BODY_BYTES = 32 * 1024 * 1024
KNOWN_PATHS = ("/health", "/metrics", "/version", "/v1/models", "/v1/completions", "/v1/chat/completions",
               "/reset_prefix_cache")
OFF_LOOP_CHARS = 16_384
_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclass
class ServerState:
    engine: Any
    served_names: list[str]
    api_key: str | None
    metrics: ServerMetrics
    token_text: R.TokenText
    created: int = field(default_factory=R.now)
    draining: bool = False
    # Set once the engine has drained: streams and waits still open end at once (see streaming._next).
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    max_body_bytes: int = MAX_BODY_BYTES

    @property
    def model_name(self) -> str:
        return self.served_names[0]


class ClientGone(Exception):
    """The client disconnected before the response started."""


class Gate:
    """Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware): refuses new requests while draining,
    checks the API key on /v1, and counts answers by route and status."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        label = path if path in KNOWN_PATHS else "other"
        status_seen: list[int] = []

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        if self.state.draining and path != "/metrics":
            self.state.metrics.rejected.labels(reason="draining").inc()
            resp = error_response(
                503, "the server is shutting down; retry on another instance", headers={"Retry-After": "5"}
            )
        elif (
            self.state.api_key
            and auth.guarded(path)
            and not auth.authorized(scope["headers"], self.state.api_key)
        ):
            self.state.metrics.rejected.labels(reason="unauthorized").inc()
            resp = error_response(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        else:
            resp = None
        try:
            if resp is not None:
                await resp(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.http.labels(
                path=label, status=str(status_seen[0] if status_seen else 499)
            ).inc()


def _served_names(args: Any, engine: Any) -> list[str]:
    names = getattr(args, "served_model_name", None)
    if isinstance(names, str):
        names = [names]
    return list(names) if names else [engine.model_name]


def build_app(engine: Any, args: Any = None) -> FastAPI:
    """The app serving `engine`. args: served_model_name (str or list), api_key (None: open)."""
    names = _served_names(args, engine)
    state = ServerState(
        engine=engine,
        served_names=names,
        api_key=auth.resolve_api_key(getattr(args, "api_key", None)),
        metrics=ServerMetrics(engine, names[0]),
        token_text=R.TokenText(engine.tokenizer),
    )
    app = FastAPI(
        title="LeverLab", version=leverlab.__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = state
    install_handlers(app)
    app.add_middleware(Gate, state=state)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, st: ServerState) -> None:
    engine = st.engine

    @app.get("/health")
    async def health() -> Response:
        if getattr(engine, "healthy", True):
            return R.OpenAIJSON({"status": "ok"})
        return error_response(503, "the engine is not running")

    @app.get("/version")
    async def version() -> Response:
        cfg = getattr(engine, "config", None)
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
                "root": str(getattr(getattr(engine, "config", None), "model", "") or name),
                "max_model_len": engine.max_model_len,
            }
            for name in st.served_names
        ]
        return R.OpenAIJSON({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            req = CompletionRequest.model_validate(await _read_json(request, st.max_body_bytes))
            _check_model(st, req.model)
            # parameter errors first, before tokenizing (max_tokens is only known after, when null)
            req.sampling_params(req.max_tokens if req.max_tokens is not None else max(1, req.min_tokens))
            prompts = [await _off_loop(encode_prompt, engine, p, size=len(p)) for p in req.prompts()]
            longest = max(len(p.token_ids) for p in prompts)
            params = req.sampling_params(default_max_tokens(req.max_tokens, longest, engine.max_model_len))
            check_token_ids(engine, params.stop_token_ids, "stop_token_ids")
            for p in prompts:
                check_fits(len(p.token_ids), params.max_tokens, engine.max_model_len)
        except Exception as e:
            return _rejected(st, e)
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
            n=params.n,
            token_text=R.TokenIdText() if req.return_tokens_as_token_ids else st.token_text,
            tokenize_s=[p.tokenize_s for p in prompts],
            echo=echo,
            prompt_logprobs_k=params.prompt_logprobs,
        )
        return await _serve(request, st, ctx, prompts, params, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            req = ChatCompletionRequest.model_validate(await _read_json(request, st.max_body_bytes))
            _check_model(st, req.model)
            # parameter errors first, before the template runs (max_tokens may need the prompt's length)
            requested = req.requested_max_tokens()
            req.sampling_params(requested if requested is not None else max(1, req.min_tokens))
            size = sum(len(str(m.content or "")) for m in req.messages)
            prompt = await _off_loop(encode_chat, engine, req, size=size)
            max_tokens = default_max_tokens(
                req.requested_max_tokens(), len(prompt.token_ids), engine.max_model_len
            )
            params = req.sampling_params(max_tokens)
            check_token_ids(engine, params.stop_token_ids, "stop_token_ids")
            check_fits(len(prompt.token_ids), max_tokens, engine.max_model_len)
        except Exception as e:
            return _rejected(st, e)
        ctx = StreamContext(
            request_id=R.new_id("chatcmpl"),
            created=R.now(),
            model=req.model or st.model_name,
            chat=True,
            logprobs_k=params.logprobs,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            n=params.n,
            token_text=st.token_text,
            tokenize_s=[prompt.tokenize_s],
        )
        return await _serve(request, st, ctx, [prompt], params, req.stream)


async def _off_loop(fn, *args, size: int):
    """Run fn(*args) here when the input is small, on a worker thread when large: tokenizing a long prompt
    takes milliseconds that every open stream would otherwise wait for."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model not in st.served_names:
        raise BadRequest(
            f"The model {model!r} does not exist; this server serves {', '.join(map(repr, st.served_names))}",
            "model",
            status=404,
            code="model_not_found",
        )


def _rejected(st: ServerState, e: Exception) -> Response:
    resp = exception_response(e)
    reason = {400: "bad_request", 404: "unknown_model", 413: "too_large", 503: "overloaded"}.get(
        resp.status_code, str(resp.status_code)
    )
    st.metrics.rejected.labels(reason=reason).inc()
    return resp


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, or a BadRequest that says what is wrong with it."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body is larger than {limit} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise BadRequest("request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8 (bad byte at offset {e.start})") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e.msg} (line {e.lineno}, column {e.colno})") from e
    except (ValueError, RecursionError) as e:  # integers past Python's digit limit, absurd nesting
        raise BadRequest(f"malformed JSON: {e}") from e
    if not isinstance(obj, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(obj).__name__}")
    if _LONE_SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(obj):
        raise BadRequest(
            "request body holds an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF): not valid text"
        )
    return obj


def _has_lone_surrogate(obj: Any) -> bool:
    if isinstance(obj, str):
        return any("\ud800" <= ch <= "\udfff" for ch in obj)
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v) for v in obj)
    return False


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
    request: Request, st: ServerState, ctx: StreamContext, prompts: list[Prompt], params: Any, stream: bool
) -> Response:
    engine = st.engine
    ids = [ctx.request_id] if len(prompts) == 1 else [f"{ctx.request_id}-{i}" for i in range(len(prompts))]
    try:
        streams = [engine.generate(p.token_ids, params, rid) for p, rid in zip(prompts, ids)]
    except Exception as e:
        return _rejected(st, e)
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
        return _rejected(st, e)
    if stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            event_stream(ctx, first, merged, len(prompts)), media_type="text/event-stream", headers=headers
        )
    return R.OpenAIJSON(_full_response(ctx, finals))


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
        choices = [R.chat_choice(tt, c, k) for c in finals[0].outputs]
    else:
        choices = [
            R.completion_choice(tt, c, p * ctx.n + c.index, k, prefix=ctx.echo[p] if ctx.echo else "",
                                prompt=out, prompt_k=ctx.prompt_logprobs_k)
            for p, out in enumerate(finals)
            for c in out.outputs
        ]
    return {
        "id": ctx.request_id,
        "object": "chat.completion" if ctx.chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": R.usage(finals),
        "timings": R.batch_timings(finals, ctx.tokenize_s),
    }
