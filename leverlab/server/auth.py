"""Optional API key: `--api-key` or LEVERLAB_API_KEY. Only the /v1 routes are guarded (as in vLLM):
/health, /metrics and /version stay open for load balancers and scrapers."""

from __future__ import annotations

import hmac
import os

ENV_VAR = "LEVERLAB_API_KEY"


def resolve_api_key(flag: str | None) -> str | None:
    key = flag if flag is not None else os.environ.get(ENV_VAR)
    return key or None


ADMIN_PATHS = ("/reset_prefix_cache",)


def guarded(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ADMIN_PATHS


def authorized(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    """True when an `Authorization: Bearer <key>` header carries the key (constant-time compare)."""
    want = api_key.encode()
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), want):
                return True
    return False
