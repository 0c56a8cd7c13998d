"""Building OpenAI response objects from the engine's RequestOutputs: choices, logprobs, usage, timings."""

from __future__ import annotations

import json
import math
import time
import uuid
from functools import lru_cache
from typing import Any

from starlette.responses import JSONResponse

from leverlab import __version__
from leverlab.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from leverlab.server.reasoning import ReasoningParser, message_fields

# JSON has no -inf; OpenAI clients expect a number. vLLM uses the same floor.
LOGPROB_FLOOR = -9999.0
# OpenAI's field (the backend configuration a response came from); vLLM sends "vllm-<version>-<hash>".
SYSTEM_FINGERPRINT = f"leverlab-{__version__}"


class OpenAIJSON(JSONResponse):
    """JSONResponse that cannot fail on strange strings: lone surrogates become U+FFFD-ish '?'."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8", errors="replace")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def dumps_in_pieces(obj: Any, max_depth: int = 4) -> bytes:
    """dumps(obj) as UTF-8 bytes, encoded container by container down to max_depth, so that no single call
    into the C encoder holds the GIL for long: one json.dumps over a 10 MB prompt_logprobs response holds it
    ~35 ms per choice, which every other thread (the event loop first) waits out. Same text as dumps()."""
    out: list[str] = []
    _pieces(obj, out, max_depth)
    # Encoded piece by piece too: one str.join and .encode over 10 MB hold the GIL ~20 ms each.
    return b"".join(p.encode("utf-8", errors="replace") for p in out)


def _pieces(obj: Any, out: list[str], depth: int) -> None:
    if (depth > 0 and isinstance(obj, dict) and any(isinstance(v, (dict, list)) for v in obj.values())
            and all(isinstance(k, str) for k in obj)):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            if i:
                out.append(",")
            out.append(dumps(k))
            out.append(":")
            _pieces(v, out, depth - 1)
        out.append("}")
    elif depth > 0 and isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj[:2]):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(",")
            _pieces(v, out, depth - 1)
        out.append("]")
    else:
        out.append(dumps(obj))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class TokenText:
    """Per-token text for logprobs, cached per token id (the same few thousand ids repeat endlessly)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tok.decode([token_id])


class TokenIdText:
    """vLLM's `return_tokens_as_token_ids`: each token shown as "token_id:N" (exact, whatever the tokenizer
    merges); used in place of TokenText."""

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"


def prompt_logprobs(tt: TokenText, out: RequestOutput, k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's shape: None for the first prompt token, then per position {"<id>": {"logprob", "rank",
    "decoded_token"}} holding the prompt's own token and the top k. Rank is 1-based: among the top k, and for
    the prompt's own token its rank in the whole vocabulary (as vLLM; null where the engine did not give it)."""
    if out.prompt_logprobs is None:
        return None
    rows: list[dict[str, Any] | None] = []
    ranks = out.prompt_ranks or []
    for i, pos in enumerate(out.prompt_logprobs):
        if pos is None:
            rows.append(None)
            continue
        top = _top(pos, k) if k > 0 else []
        rank = {tid: r + 1 for r, (tid, _) in enumerate(top)}
        if i < len(ranks) and ranks[i] is not None and i < len(out.prompt_token_ids):
            rank.setdefault(out.prompt_token_ids[i], ranks[i])
        rows.append({str(tid): {"logprob": _finite(lp), "rank": rank.get(tid), "decoded_token": tt.text(tid)}
                     for tid, lp in pos.items()})
    return rows


def _top(pos: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    return sorted(pos.items(), key=lambda kv: kv[1], reverse=True)[:k]


def completion_logprobs(
    tt: TokenText, token_ids: list[int], logprobs: list[PositionLogprobs | None], k: int, text_offset: int = 0
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists plus a dict per position of the chosen token and the top k
    (vLLM's: the chosen token first, so logprobs=0 still shows it, and a sampled token outside the top k too).
    A None position (an echoed prompt's first token) gets null logprob and null top_logprobs, as vLLM's."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, logprobs):
        s = tt.text(tid)
        if pos is None:  # the first prompt token of an echo: nothing before it to predict it from
            tokens.append(s)
            token_lps.append(None)
            tops.append(None)
            offsets.append(text_offset)
            text_offset += len(s)
            continue
        lp = _finite(pos.get(tid, LOGPROB_FLOOR))
        tokens.append(s)
        token_lps.append(lp)
        top = {s: lp}
        for t, x in _top(pos, k):  # two ids can print as one text: the first (most likely) keeps the key
            top.setdefault(tt.text(t), _finite(x))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_token(tt: TokenText, tid: int, lp: float) -> dict[str, Any]:
    s = tt.text(tid)
    return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8", errors="replace"))}


def chat_logprobs(
    tt: TokenText, token_ids: list[int], logprobs: list[PositionLogprobs], k: int
) -> dict[str, Any]:
    content = []
    for tid, pos in zip(token_ids, logprobs):
        entry = _chat_token(tt, tid, pos.get(tid, LOGPROB_FLOOR))
        entry["top_logprobs"] = [_chat_token(tt, t, lp) for t, lp in _top(pos, k)]
        content.append(entry)
    return {"content": content}


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.num_cached_prompt_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings(out: RequestOutput, server_tokenize_s: float = 0.0) -> dict[str, float]:
    """Where the time went, in ms (the llama.cpp-style `timings` extension field).

    The server's own tokenization (chat template + tokenizer) is added to the engine's tokenize time.
    ttft_ms and e2e_ms are measured from the engine's arrival time.
    """
    m = out.metrics
    t = m.timings()
    t["tokenize_ms"] += 1e3 * server_tokenize_s
    if m.ttft is not None:
        t["ttft_ms"] = 1e3 * m.ttft
    end = m.finished_time or m.last_token_time
    if end is not None:
        t["e2e_ms"] = 1e3 * (end - m.arrival_time)
    t["prompt_tokens"] = len(out.prompt_token_ids)
    t["cached_prompt_tokens"] = m.num_cached_prompt_tokens
    t["completion_tokens"] = sum(len(c.token_ids) for c in out.outputs)
    return t


def batch_timings(outs: list[RequestOutput], tokenize_s: list[float]) -> dict | list[dict]:
    """One dict for one prompt; a list (one per prompt) for a batch of prompts."""
    ts = [timings(o, s) for o, s in zip(outs, tokenize_s)]
    return ts[0] if len(ts) == 1 else ts


def completion_choice(
    tt: TokenText, c: CompletionOutput, index: int, k: int | None, prefix: str = "",
    prompt: RequestOutput | None = None, prompt_k: int | None = None, token_ids: bool = False,
    echo: bool = False, echo_only: bool = False, asked_prompt_logprobs: bool = True,
) -> dict[str, Any]:
    """`prompt`/`prompt_k`: the request's output and k when the client asked for prompt_logprobs; `token_ids`:
    vLLM's return_token_ids. The three vLLM keys are always there (null when not asked for), as in vLLM's
    responses, so a client written against vLLM can index them. `echo`: the prompt's tokens lead the logprobs
    (from prompt_logprobs); `echo_only` (max_tokens 0): only the prompt, its text and its logprobs."""
    lp = None
    text = c.text
    if echo_only:
        text = ""
    if k is not None and c.logprobs is not None:
        ids, lps = ([], []) if echo_only else (list(c.token_ids), list(c.logprobs))
        if echo and prompt is not None and prompt.prompt_logprobs is not None:
            ids, lps = list(prompt.prompt_token_ids) + ids, list(prompt.prompt_logprobs) + lps
        lp = completion_logprobs(tt, ids, lps, k)
    # prompt_token_ids beside prompt_logprobs the client asked for; echo's own need for them does not add
    # the ids (as vLLM, which returns them then only with return_token_ids)
    with_prompt_lp = prompt is not None and prompt_k is not None and asked_prompt_logprobs
    return {
        "index": index,
        "text": prefix + text,
        "logprobs": lp,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "token_ids": list(c.token_ids) if token_ids else None,
        "prompt_logprobs": prompt_logprobs(tt, prompt, prompt_k) if prompt is not None and prompt_k is not None else None,
        # with prompt_logprobs too: which token each row is for
        "prompt_token_ids": prompt.prompt_token_ids if prompt is not None and (token_ids or with_prompt_lp) else None,
    }


def chat_choice(tt: TokenText, c: CompletionOutput, k: int | None, token_ids: bool = False,
                reasoning: ReasoningParser | None = None, include_reasoning: bool = True) -> dict[str, Any]:
    """`reasoning`: the request's --reasoning-parser (None: off), which splits the text into reasoning and
    content."""
    lp = None
    if k is not None and c.logprobs is not None:
        lp = chat_logprobs(tt, c.token_ids, c.logprobs, k)
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if reasoning is not None:
        message.update(message_fields(*reasoning.split(c.text), include=include_reasoning))
    return {
        "index": c.index,
        "message": message,
        "logprobs": lp,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "token_ids": list(c.token_ids) if token_ids else None,
    }
