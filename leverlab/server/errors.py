"""Every failure as an OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with its status.

Bad input is always 4xx with a message that says what to fix; overload and a dead engine are 503
(overload with Retry-After); anything else is a bug, answered 500 in the same shape and logged.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from leverlab.errors import EngineDeadError, EngineOverloaded, RequestError, UnsupportedLever
from leverlab.server.protocol import BadRequest
from leverlab.server.responses import OpenAIJSON

log = logging.getLogger("leverlab.server")

RETRY_AFTER_S = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> OpenAIJSON:
    body = error_body(message, _TYPES.get(status, "invalid_request_error"), param, code)
    return OpenAIJSON(body, status_code=status, headers=headers)


# Union members and tagged types that pydantic puts into an error's location ("content.str", "list[TextPart]").
_LOC_NOISE = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|function-.*)$")


def pydantic_message(e: ValidationError) -> tuple[str, str | None]:
    """The problems at the first bad field, as 'field: what is wrong', plus the dotted field name."""
    errs = e.errors(include_url=False)
    if not errs:
        return "invalid request body", None

    def loc(err: dict) -> str:
        return ".".join(
            str(x) for x in err.get("loc", ()) if not (isinstance(x, str) and _LOC_NOISE.match(x))
        )

    where = loc(errs[0])
    if errs[0].get("type") == "missing":
        return f"{where} is required", where or None
    msgs = list(dict.fromkeys(err.get("msg", "invalid value") for err in errs if loc(err) == where))
    text = ", or ".join(msgs)
    return (f"{where}: {text}" if where else text), where or None


def map_exception(e: BaseException) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """(status, body, headers) for an exception raised while serving a request."""
    if isinstance(e, BadRequest):
        return (
            e.status,
            error_body(e.message, _TYPES.get(e.status, "invalid_request_error"), e.param, e.code),
            None,
        )
    if isinstance(e, ValidationError):
        msg, param = pydantic_message(e)
        return 400, error_body(msg, "invalid_request_error", param), None
    if isinstance(e, RequestError):
        return 400, error_body(str(e), "invalid_request_error", e.param, e.code), None
    if isinstance(e, UnsupportedLever):
        return 400, error_body(str(e), "invalid_request_error"), None
    if isinstance(e, EngineOverloaded):
        msg = str(e) or "the server is overloaded: too many requests waiting"
        return 503, error_body(msg, "overloaded_error"), {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(e, EngineDeadError):
        return 503, error_body(f"the engine is not running: {e}", "service_unavailable"), None
    return 500, error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), None


def exception_response(e: BaseException) -> OpenAIJSON:
    status, body, headers = map_exception(e)
    if status == 500:
        log.error("unexpected error", exc_info=e)
    return OpenAIJSON(body, status_code=status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> OpenAIJSON:
        msg = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> OpenAIJSON:
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> OpenAIJSON:
        return exception_response(exc)
