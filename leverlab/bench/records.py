"""The data that flows through the harness: what to send (BenchRequest) and what came back (RequestRecord)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class BenchRequest:
    """One request to send. Exactly one of prompt (completions) / messages (chat) is needed; the client
    derives the other form when the endpoint wants it."""

    id: str
    bucket: str
    output_len: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_tokens: int | None = None  # as the workload counted them; the server's usage wins when given
    source: str | None = None
    # Request fields of its own (structured output, tools: the agent workload). Such a request ends where its
    # grammar does: output_len is its max_tokens, not an exact length (no ignore_eos).
    body: dict[str, Any] | None = None


@dataclass(slots=True)
class RequestRecord:
    """One request's measurement. Times are seconds from time.perf_counter(); start_s is relative to the
    run's first send so records from one run share a clock."""

    id: str
    group: str
    bucket: str
    output_len: int  # requested
    exact_len: bool = True  # False: output_len was a cap (a grammar ends the request), not checked
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # one gap per token-bearing chunk after the first
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each token-bearing chunk (best known)
    prompt_tokens: int | None = None
    cached_tokens: int | None = (
        None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits), if given
    )
    output_tokens: int | None = None
    output_tokens_source: str | None = None  # "usage" | "chunks"
    finish_reason: str | None = None
    server_timings: dict[str, float] | None = None
    text_chars: int = 0
    concurrency: int | None = None
    request_rate: float | None = None
    queue_wait_s: float = 0.0  # static batching: the wait for the previous batch, included in ttft_s and e2e_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
