"""What every route shares: the server's state (ServerState), its limits, and reading a request.

Reading a body under the byte admission, checking the model name and logprobs bounds, and turning an exception
into its error response (counted in the metrics) are the same for the completion routes (app.py) and the token
routes (tokens_api.py), which both import them from here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.responses import Response

from leverlab.engine.client import EngineClient
from leverlab.server import responses as R
from leverlab.server.admission import Admission
from leverlab.server.body import BodyParser, Limits
from leverlab.server.errors import exception_response
from leverlab.server.gen_config import SamplingDefaults
from leverlab.server.metrics import ServerMetrics
from leverlab.server.protocol import BadRequest
from leverlab.server.reasoning import ReasoningParser
from leverlab.server.templates import TemplatePolicy

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_INFLIGHT_BODY_BYTES = 2 * MAX_BODY_BYTES
OFF_LOOP_CHARS = 16_384
# A stream whose client has not taken a chunk for this long is aborted (its KV blocks freed).
STREAM_STALL_TIMEOUT_S = 60.0
WORKER_THREADS = 4


@dataclass
class ServerState:
    engine: EngineClient
    served_names: list[str]
    api_key: str | None
    metrics: ServerMetrics
    token_text: R.TokenText
    admission: Admission
    limits: Limits
    # Parsing, tokenizing, template rendering and building big responses run here, off the event loop.
    pool: concurrent.futures.ThreadPoolExecutor
    parser: BodyParser
    templates: TemplatePolicy = field(default_factory=TemplatePolicy)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_logprobs: int = 20
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    log_requests: bool = True
    allowed_origins: tuple[str, ...] = ()
    stall_timeout_s: float = STREAM_STALL_TIMEOUT_S
    created: int = field(default_factory=R.now)
    draining: bool = False
    # Set once the engine has drained: streams and waits still open end at once (see streaming._next).
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    max_body_bytes: int = MAX_BODY_BYTES
    # Tool calling (server/tools.py): tool_choice "auto" needs both, as in vLLM
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_names[0]


class ClientGone(Exception):
    """The client disconnected before the response started."""


def check_logprobs(st: ServerState, logprobs: int | None, prompt_logprobs: int | None) -> None:
    """--max-logprobs: vLLM's bound on top-k logprobs a request may ask for (each costs response bytes)."""
    for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if k is not None and k > st.max_logprobs:
            raise BadRequest(f"{name} must be at most {st.max_logprobs} on this server (--max-logprobs), got {k}",
                             name)


async def off_loop(st: ServerState, fn, *args, size: int):
    """Run fn(*args) here when the input is small, on a worker thread when large: tokenizing a long prompt
    takes milliseconds that every open stream would otherwise wait for."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.get_running_loop().run_in_executor(st.pool, fn, *args)
    return fn(*args)


async def read_request(request: Request, st: ServerState, model: type) -> Any:
    """The body, read under the byte admission and parsed (off the loop when big) as `model`."""
    length = request.headers.get("content-length")
    try:
        declared = max(0, int(length)) if length is not None else 0
    except ValueError:
        raise BadRequest("Content-Length is not a number") from None
    ticket = st.admission.reserve_bytes(declared)
    try:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > ticket.nbytes:
                st.admission.grow_bytes(ticket, size - ticket.nbytes)
            chunks.append(chunk)
        return await st.parser.parse(b"".join(chunks), model, st.limits)
    finally:
        ticket.release()


def check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model not in st.served_names:
        raise BadRequest(
            f"The model {model!r} does not exist; this server serves {', '.join(map(repr, st.served_names))}",
            "model",
            status=404,
            code="model_not_found",
        )


def rejected(st: ServerState, e: Exception) -> Response:
    resp = exception_response(e)
    reason = {400: "bad_request", 404: "unknown_model", 413: "too_large", 503: "overloaded"}.get(
        resp.status_code, str(resp.status_code)
    )
    st.metrics.rejected.labels(reason=reason).inc()
    return resp
