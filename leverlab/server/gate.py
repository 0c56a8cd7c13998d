"""The ASGI gate in front of every route: draining, JSON-only bodies, web pages' origins, the API key."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from leverlab.server import auth
from leverlab.server.errors import error_response
from leverlab.server.state import ServerState

# Routes whose body is a JSON request: anything else is 415, so that a web page cannot make a local server
# work with a CORS-"simple" (text/plain, form) request, which browsers send without asking first.
JSON_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
KNOWN_PATHS = ("/health", "/metrics", "/version", "/v1/models", "/reset_prefix_cache", *JSON_PATHS)


class Gate:
    """Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware): refuses new requests while draining,
    bodies that are not JSON (415), web pages' requests from origins not allowed (403), and requests without
    the API key on /v1; counts answers by route and status."""

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
        elif scope["method"] == "POST" and path in JSON_PATHS and not _is_json(scope["headers"]):
            self.state.metrics.rejected.labels(reason="unsupported_media_type").inc()
            resp = error_response(415, "send the body as JSON with 'Content-Type: application/json'")
        elif (origin := _header(scope["headers"], b"origin")) is not None and (
            auth.guarded(path) or path in JSON_PATHS
        ) and not ("*" in self.state.allowed_origins or origin in self.state.allowed_origins):
            self.state.metrics.rejected.labels(reason="origin").inc()
            resp = error_response(403, f"requests from web pages (Origin {origin}) are refused; the operator can "
                                  "allow an origin with --allowed-origins")
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


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    ctype = _header(headers, b"content-type")
    if ctype is None:
        return False
    media = ctype.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
