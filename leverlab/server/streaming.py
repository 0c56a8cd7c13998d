"""Server-sent events as OpenAI clients expect them.

The engine yields cumulative outputs (text and token ids only grow); each chunk carries the difference since
the last one, per choice. Every choice gets exactly one chunk with its finish_reason. With
`stream_options.include_usage`, every chunk has `"usage": null` (with vLLM's `continuous_usage_stats`: the
request's usage so far) and one last chunk with no choices carries the usage. The last chunk also carries the
`timings` extension field and `system_fingerprint`. The stream ends with `data: [DONE]`.

vLLM's `return_token_ids`: each choice's chunk carries its new token ids (`token_ids`, null otherwise), and the
prompt's ids come once (completions: in each choice's first chunk; chat: top-level in the first chunk).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from leverlab.outputs import CompletionOutput, RequestOutput
from leverlab.server import responses as R
from leverlab.server.errors import error_body, map_exception
from leverlab.server.reasoning import ReasoningParser, ReasoningStream, message_fields
from leverlab.server.tools import ToolPlan, ToolStream

log = logging.getLogger("leverlab.server")

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {R.dumps(obj)}\n\n"


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams (one per prompt of a batch), tagged with the prompt's position.

    Closing this generator cancels the pumps, which close the engine streams (and so abort the requests).
    """
    if len(streams) == 1:  # the common case: no tasks, no queue
        async for out in streams[0]:
            yield 0, out
        return
    # Bounded: when the consumer is slow the pumps wait, and each engine stream's mailbox coalesces its outputs
    # (an unbounded queue here would keep one full cumulative output per step per prompt).
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    end = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, end))
        except BaseException as e:  # noqa: B036 - forwarded to the consumer, which re-raises
            await queue.put((i, e))
            raise
        finally:
            if hasattr(s, "aclose"):
                await s.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is end:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Sent:
    text: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False
    reasoning: ReasoningStream | None = None  # this choice's reasoning split, with --reasoning-parser
    content: str = ""  # chat with tools: the content so far, which the tool parser reads
    tools: ToolStream | None = None  # chat with tools: what content and calls went out


@dataclass
class StreamContext:
    request_id: str
    created: int
    model: str
    chat: bool
    logprobs_k: int | None  # None: no logprobs
    include_usage: bool
    n: int
    token_text: R.TokenText
    tokenize_s: list[float]  # server tokenize time, per prompt
    echo: list[str] | None = None  # completions echo: prompt text per prompt
    echo_only: bool = False  # echo with max_tokens 0: the one token the engine ran is not shown
    # prompt_token_ids come with prompt_logprobs the request asked for (not with those echo's logprobs need)
    asked_prompt_logprobs: bool = True
    reasoning: ReasoningParser | None = None  # chat: this request's reasoning parser (None: off)
    include_reasoning: bool = True
    prompt_logprobs_k: int | None = None  # prompt_logprobs (never streamed)
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage so far in every chunk
    return_token_ids: bool = False  # vLLM's return_token_ids
    tools: ToolPlan | None = None  # chat with tools (server/tools.py)
    on_finished: Callable[[RequestOutput], None] | None = None
    on_aborted: Callable[[], None] | None = None
    # Shutdown: `draining()` turns true at SIGTERM; `stop` is set once the engine has drained, and a stream
    # still open then ends with 'abort'. Racing each chunk against `stop` costs a task per chunk, so streams
    # only do it while draining (a running stream gets there within one token).
    stop: asyncio.Event | None = None
    draining: Callable[[], bool] = lambda: False
    on_done: Callable[[], None] | None = None  # the stream ended, however (releases the admission ticket)

    finals: dict[int, RequestOutput] = field(default_factory=dict)


def _delta_choice(ctx: StreamContext, c: CompletionOutput, index: int, sent: _Sent,
                  prompt_ids: list[int]) -> dict | None:
    new_text = "" if ctx.echo_only else c.text[sent.text :]  # echo_only: the engine's one token is not shown
    new_ids = [] if ctx.echo_only else c.token_ids[sent.tokens :]
    finish = c.finish_reason if c.finished and not sent.finished else None
    first = not sent.started
    wants_logprobs = ctx.logprobs_k is not None and bool(new_ids)
    if not new_text and not wants_logprobs and finish is None and not (first and ctx.echo):
        return None  # tokens whose text is held back (partial UTF-8, a possible stop string): nothing to show
    lp = None
    if ctx.logprobs_k is not None and c.logprobs is not None and new_ids:
        pos = c.logprobs[sent.tokens : sent.tokens + len(new_ids)]
        if ctx.chat:
            lp = R.chat_logprobs(ctx.token_text, new_ids, pos, ctx.logprobs_k)
        else:
            lp = R.completion_logprobs(ctx.token_text, new_ids, pos, ctx.logprobs_k, text_offset=sent.text)
    sent.text, sent.tokens, sent.started = len(c.text), len(c.token_ids), True
    sent.finished = sent.finished or finish is not None
    token_ids = list(new_ids) if ctx.return_token_ids else None
    if ctx.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if ctx.reasoning is None:
            delta["content"] = new_text
        else:
            sent.reasoning = sent.reasoning or ctx.reasoning.stream()
            r, content = sent.reasoning.feed(new_text, final=finish is not None)
            if not r and not content and not first and finish is None and lp is None:
                return None  # all held back: it may be the start of a tag
            delta.update(message_fields(r or None, content, ctx.include_reasoning, delta=True))
            if delta["content"] == "" and "reasoning" in delta:
                del delta["content"]  # a reasoning delta carries no content key, as vLLM's
        if ctx.tools is not None:  # tool calls split out of the content (server/tools.py)
            sent.tools = sent.tools or ToolStream(ctx.tools)
            sent.content += delta.pop("content", None) or ""
            delta.update(sent.tools.delta(sent.content, c.finished))
            finish = sent.tools.finish_reason(finish)
            if set(delta) <= {"role"} and lp is None and finish is None and not first:
                return None
        return {
            "index": index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
            "token_ids": token_ids,
        }
    if first and ctx.echo:
        new_text = ctx.echo[index // ctx.n] + new_text
    return {
        "index": index,
        "text": new_text,
        "logprobs": lp,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
        "token_ids": token_ids,
        "prompt_token_ids": list(prompt_ids) if first and ctx.return_token_ids else None,
    }


def _chunk(ctx: StreamContext, choices: list[dict]) -> dict:
    obj: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk" if ctx.chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    if ctx.include_usage:
        obj["usage"] = None
    return obj


async def event_stream(
    ctx: StreamContext,
    first: tuple[int, RequestOutput] | None,
    rest: AsyncIterator[tuple[int, RequestOutput]],
    num_prompts: int,
) -> AsyncIterator[str]:
    """SSE lines for one request; `first` is the output already awaited before the response started."""
    sent: dict[tuple[int, int], _Sent] = {}
    # continuous_usage_stats: each prompt's length and each choice's tokens so far (held-back ones included)
    prompt_len: dict[int, int] = {}
    generated: dict[tuple[int, int], int] = {}
    first_chunk = True
    stop_wait: asyncio.Future | None = None
    try:
        pending = [first] if first is not None else []
        while True:
            if pending:
                p, out = pending.pop()
            else:
                if stop_wait is None and ctx.stop is not None and ctx.draining():
                    stop_wait = asyncio.ensure_future(ctx.stop.wait())
                try:
                    p, out = await _next(rest, stop_wait)
                except StopAsyncIteration:
                    break
                except _Stopped:
                    yield sse(_chunk(ctx, _abort_choices(ctx, sent, num_prompts)))
                    break
            choices = []
            prompt_len[p] = len(out.prompt_token_ids)
            for c in out.outputs:
                index = p * ctx.n + c.index
                generated[(p, c.index)] = len(c.token_ids)
                ch = _delta_choice(ctx, c, index, sent.setdefault((p, c.index), _Sent()), out.prompt_token_ids)
                if ch is not None:
                    choices.append(ch)
            if out.finished:
                ctx.finals[p] = out
                if ctx.on_finished is not None:
                    ctx.on_finished(out)
            last = len(ctx.finals) == num_prompts
            chunk = _chunk(ctx, choices)
            if ctx.chat and first_chunk and choices:  # vLLM: the prompt's ids once, in the first chunk
                chunk["prompt_token_ids"] = list(out.prompt_token_ids) if ctx.return_token_ids else None
            if ctx.continuous_usage:
                chunk["usage"] = _usage_so_far(prompt_len, generated)
            if last and not ctx.include_usage:
                chunk["system_fingerprint"] = R.SYSTEM_FINGERPRINT
                chunk["timings"] = _timings(ctx)
            if choices or "timings" in chunk:
                first_chunk = False
                yield sse(chunk)
            if last:
                break
        if ctx.include_usage and len(ctx.finals) == num_prompts:
            finals = [ctx.finals[i] for i in range(num_prompts)]
            chunk = _chunk(ctx, [])
            chunk["usage"] = R.usage(finals)
            chunk["system_fingerprint"] = R.SYSTEM_FINGERPRINT
            chunk["timings"] = _timings(ctx)
            yield sse(chunk)
    except asyncio.CancelledError:
        raise  # the client went away: the finally clauses abort the requests
    except Exception as e:  # the engine died mid-stream: tell the client in-band, then end cleanly
        status, body, _ = map_exception(e)
        if status >= 500 and status != 503:
            log.exception("error while streaming %s", ctx.request_id)
        yield sse(body if "error" in body else error_body(str(e), "server_error"))
    finally:
        if stop_wait is not None:
            stop_wait.cancel()
        if len(ctx.finals) < num_prompts and ctx.on_aborted is not None:
            ctx.on_aborted()
        if hasattr(rest, "aclose"):
            await rest.aclose()
        if ctx.on_done is not None:
            ctx.on_done()
    yield DONE


def _usage_so_far(prompt_len: dict[int, int], generated: dict[tuple[int, int], int]) -> dict[str, int]:
    """The request's usage at this chunk: the prompts seen so far and every choice's tokens so far (vLLM's
    chunks carry one choice each and count that choice; ours may carry several, so the request's total)."""
    prompt, completion = sum(prompt_len.values()), sum(generated.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Stopped(Exception):
    """The server finished draining while this stream was still open."""


async def _next(rest: AsyncIterator, stop_wait: asyncio.Future | None):
    """The next output, or _Stopped once the server has drained (the engine will send nothing more)."""
    if stop_wait is None:
        return await anext(rest)
    if stop_wait.done():
        raise _Stopped()
    nxt = asyncio.ensure_future(anext(rest))
    try:
        await asyncio.wait({nxt, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
    if nxt.cancelled():
        raise _Stopped()
    return nxt.result()


def _abort_choices(ctx: StreamContext, sent: dict[tuple[int, int], _Sent], num_prompts: int) -> list[dict]:
    """One last chunk per unfinished choice, with finish_reason 'abort' (vLLM's name for it)."""
    choices = []
    for p in range(num_prompts):
        for i in range(ctx.n):
            if p in ctx.finals or sent.get((p, i), _Sent()).finished:
                continue
            ch: dict[str, Any] = {"index": p * ctx.n + i, "logprobs": None, "finish_reason": "abort"}
            if ctx.chat:
                ch["delta"] = {}
            else:
                ch["text"] = ""
            choices.append(ch)
    return choices


def _timings(ctx: StreamContext) -> dict | list[dict]:
    n = len(ctx.finals)
    return R.batch_timings([ctx.finals[i] for i in range(n)], ctx.tokenize_s[:n])


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that gives up on a client that stops reading.

    When the client stops reading, the socket buffers fill and each send waits. A send that waits longer than
    `stall_timeout_s` ends the response: the event generator is closed (which aborts the engine requests and
    frees their KV blocks) and the connection is dropped. Memory meanwhile stays bounded: the engine side
    keeps only the latest cumulative output per request (async_engine._Mailbox).
    """

    def __init__(self, content, *, stall_timeout_s: float, on_stall: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.stall_timeout_s, self.on_stall = stall_timeout_s, on_stall

    async def stream_response(self, send: Send) -> None:
        async def guarded(message: dict) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                raise _Stalled() from None

        try:
            await super().stream_response(guarded)
        except _Stalled:
            self.on_stall()
            await self.body_iterator.aclose()
            # Returning with the response unfinished makes the server close the connection.


class _Stalled(Exception):
    """The client took nothing for stall_timeout_s."""
