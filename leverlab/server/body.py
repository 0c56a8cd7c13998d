"""Request bodies: read within a byte limit, parsed as JSON and validated, never on the event loop when big.

Python's JSON parser holds the GIL for a whole document: 25 MB of token ids take 0.75 s, during which a
worker thread would freeze the event loop as surely as parsing on it. So bodies up to INLINE_BYTES parse on
the loop (microseconds), up to THREAD_BYTES on a thread (tens of ms at most), and larger ones in a separate
process, which validates the request and checks the limits that need no tokenizer (`Limits`) before sending
anything back: what crosses back is bounded by what could ever fit the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from leverlab.server.protocol import BadRequest

INLINE_BYTES = 16 * 1024
THREAD_BYTES = 512 * 1024
_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclass(frozen=True)
class Limits:
    """What any request must satisfy to have a chance of fitting, known without tokenizing."""

    max_model_len: int
    vocab_size: int
    # Upper bound on the UTF-8 bytes one token can stand for (4 x the longest vocabulary entry in chars):
    # a text longer than max_model_len x this can never fit, and is refused before it is tokenized.
    max_token_bytes: int

    @property
    def max_text_bytes(self) -> int:
        return self.max_model_len * self.max_token_bytes


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a BadRequest that says what is wrong with it."""
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


def parse_request(raw: bytes, model: type, limits: Limits) -> Any:
    """Parse, validate as `model` (a protocol request class) and check `limits` (its `check_limits`)."""
    req = model.model_validate(parse_json(raw))
    req.check_limits(limits)
    return req


PROCESS_NAME = b"leverlab-parser"  # its /proc/PID/comm, so that tools (and tests) can tell it from TP ranks


def _lower_priority() -> None:
    """The parser process yields the cores to the server's event loop and engine: parsing a hostile 30 MB
    body may take a second, and must not take it from the requests being served."""
    try:
        os.nice(10)
    except OSError:
        pass
    try:  # Linux: name the process (PR_SET_NAME)
        import ctypes

        ctypes.CDLL(None).prctl(15, PROCESS_NAME, 0, 0, 0)
    except Exception:  # noqa: BLE001 - a name is a convenience
        pass


def _in_worker(raw: bytes, model: type, limits: Limits) -> tuple[str, Any]:
    """parse_request in the worker process; errors come back as data (BadRequest does not pickle as is)."""
    from leverlab.server.errors import pydantic_message

    try:
        return "ok", parse_request(raw, model, limits)
    except BadRequest as e:
        return "bad", (e.message, e.param, e.status, e.code)
    except ValidationError as e:
        msg, param = pydantic_message(e)
        return "bad", (msg, param, 400, None)


class BodyParser:
    """Parses bodies where their size allows (see the module docstring). One worker process, started on the
    first big body; `close()` stops it."""

    def __init__(self, threads: concurrent.futures.Executor):
        self.threads = threads
        self._procs: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self, model: type, limits: Limits) -> None:
        """Start the worker process now, from a worker thread, and have it parse one small body (so that its
        imports are done too): on the first big body, the spawn (~100+ ms in a process with torch loaded)
        would run on the event loop, and the child's imports would compete for the cores."""
        self.threads.submit(lambda: self._pool().submit(_in_worker, b'{"prompt": "x"}', model, limits).result())

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._procs is None:
                # spawn: never fork a process that runs the engine's threads
                self._procs = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=mp.get_context("spawn"), initializer=_lower_priority)
            return self._procs

    async def parse(self, raw: bytes, model: type, limits: Limits) -> Any:
        if len(raw) <= INLINE_BYTES:
            return parse_request(raw, model, limits)
        loop = asyncio.get_running_loop()
        if len(raw) <= THREAD_BYTES:
            return await loop.run_in_executor(self.threads, parse_request, raw, model, limits)
        try:
            kind, value = await loop.run_in_executor(self._pool(), _in_worker, raw, model, limits)
        except concurrent.futures.process.BrokenProcessPool:
            with self._lock:
                self._procs = None  # the worker died (killed, out of memory): the next big body starts another
            raise BadRequest("the request body could not be parsed (the parser process died); "
                             "send a smaller body", status=413) from None
        if kind == "bad":
            message, param, status, code = value
            raise BadRequest(message, param, status=status, code=code)
        return value

    def close(self) -> None:
        if self._procs is not None:
            self._procs.shutdown(wait=False, cancel_futures=True)
