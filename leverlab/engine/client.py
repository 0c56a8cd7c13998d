"""The seam between the HTTP server and an engine: `EngineClient`, and the prompt that crosses it.

The server codes against this protocol only; AsyncLLM (async_engine.py) and the tests' fake engine
(tests/server/fake_engine.py) both implement it. A prompt crosses the seam as an `EnginePrompt`: token ids
already checked against the vocabulary and the context length by the one function that checks them
(`validate_prompt`), so neither side checks it again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from leverlab.config import EngineConfig
from leverlab.errors import RequestError
from leverlab.outputs import RequestOutput
from leverlab.sampling_params import SamplingParams


@dataclass(frozen=True)
class EnginePrompt:
    """A prompt as token ids that fit: every id in [0, vocab) and len + max_tokens <= max_model_len.

    Built only by `validate_prompt`; `text` is the prompt text where the caller gave text (echo, logs), and
    `tokenize_s` the time the caller spent turning it into ids (chat template + tokenizer)."""

    token_ids: list[int]
    text: str | None = None
    tokenize_s: float = 0.0


def validate_prompt(token_ids: list[int], max_tokens: int | None, vocab_size: int, max_model_len: int,
                    text: str | None = None, tokenize_s: float = 0.0) -> EnginePrompt:
    """The one check of a prompt. RequestError (HTTP 400) names what to fix, with both numbers."""
    if not token_ids:
        raise RequestError("prompt is empty" if text is None else "prompt is empty after tokenization", "prompt")
    bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token ids must be in the vocabulary [0, {vocab_size}); got {bad!r}",
                           "prompt")
    n = len(token_ids)
    room = max_model_len - n
    if max_tokens is None and room < 1:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens, and the prompt "
                           f"alone takes {n} tokens. Please shorten the prompt.", "prompt",
                           "context_length_exceeded")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.", "max_tokens", "context_length_exceeded")
    return EnginePrompt(list(token_ids), text, tokenize_s)


def to_engine_prompt(prompt: str | list[int] | EnginePrompt, max_tokens: int | None, tokenizer: Any,
                     vocab_size: int, max_model_len: int) -> EnginePrompt:
    """A prompt from the Python API (text or ids) as an EnginePrompt; one already checked passes through."""
    if isinstance(prompt, EnginePrompt):
        return prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty")
        return validate_prompt(tokenizer.encode(prompt, add_special_tokens=False), max_tokens, vocab_size,
                               max_model_len, text=prompt)
    return validate_prompt(list(prompt), max_tokens, vocab_size, max_model_len)


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs of an engine.

    generate() raises before yielding anything: RequestError (400), EngineOverloaded (503 + Retry-After),
    EngineDeadError (503). Outputs are cumulative (text and token ids only grow); a slow consumer may skip
    intermediate ones (it always gets the latest, and always the final one). Closing the iterator early
    aborts the request and frees its KV blocks.
    """

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids must be below this (the model's, possibly padded, vocabulary)
    config: EngineConfig | None  # as configured (/version, /v1/models' root); None: an engine without one
    quantization: str | None  # the weights' method as loaded (a pre-quantized checkpoint names its own)

    @property
    def healthy(self) -> bool:
        """Serving: False once it cannot run a step any more (/health answers 503)."""
        ...

    @property
    def degraded(self) -> bool:
        """Serving with less than it started with (data parallel: some replicas left, the others serve)."""
        ...

    def health(self) -> dict[str, Any]:
        """What /health adds to its status: each replica's state for a set of replicas; {} for one engine."""
        ...

    @property
    def capacity_seqs(self) -> int:
        """The most sequences (prompts x n) it holds at once, running and waiting; a request with more can
        never be admitted."""
        ...

    def generate(self, prompt: EnginePrompt, params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> int: ...

    def stats(self) -> Any: ...

    async def shutdown(self, drain_timeout_s: float) -> None: ...
