"""One streaming request, timed the way `vllm bench serve` times it.

Clock: time.perf_counter(), read when each SSE `data:` line has been received and parsed.
- TTFT: send -> first token-bearing chunk.
- ITL: one gap per token-bearing chunk after the first (a chunk that packs several tokens, e.g. from
  speculative decoding, still gives one gap, as in vllm).
- E2E: send -> last token-bearing chunk (the trailing usage chunk and [DONE] do not count).
A token-bearing chunk is any chunk with a non-empty `choices` list (vllm's rule; its text may be empty,
e.g. for a special token), except a chat chunk that only announces the assistant role, which some
servers send before any token is computed.
Output tokens: usage.completion_tokens (stream_options.include_usage) when the server gives it; else
the sum of tokens per chunk (token_ids or logprobs when present, otherwise 1 per chunk).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from leverlab.bench.records import BenchRequest, RequestRecord

# llama.cpp's server reports its own `timings` (prompt_ms, predicted_ms); map them onto our parts.
_TIMING_ALIASES = {"prompt_ms": "prefill_ms", "predicted_ms": "decode_ms"}


def build_payload(
    req: BenchRequest,
    *,
    model: str,
    endpoint: str,
    temperature: float,
    ignore_eos: bool,
    min_tokens: bool = False,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        payload["messages"] = req.messages or [{"role": "user", "content": req.prompt or ""}]
    else:
        payload["prompt"] = req.prompt if req.prompt is not None else _flatten(req.messages or [])
    # vLLM's extensions (our server follows them) hold the output length exact so runs compare. ignore_eos
    # alone is what `vllm bench serve` sends and suffices with max_tokens; min_tokens is opt-in for servers
    # that honour it but not ignore_eos. The harness checks the lengths either way (output_len_mismatches).
    if req.body is not None:  # its grammar ends it: no exact length
        payload.update(req.body)
    else:
        if ignore_eos:
            payload["ignore_eos"] = True
        if min_tokens:
            payload["min_tokens"] = req.output_len
    if extra_body:
        payload.update(extra_body)
    return payload


def _flatten(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(str(m.get("content", "")) for m in messages)


def _chunk_token_count(choice: dict[str, Any]) -> int:
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if isinstance(lp.get("tokens"), list):  # completions
            return len(lp["tokens"])
        if isinstance(lp.get("content"), list):  # chat
            return len(lp["content"])
    return 1


def _is_token_chunk(choice: dict[str, Any], endpoint: str) -> bool:
    if endpoint != "chat":
        return True
    delta = choice.get("delta") or {}
    announces_role_only = (
        "role" in delta
        and not delta.get("content")
        and not delta.get("reasoning_content")
        and not delta.get("tool_calls")
        and choice.get("finish_reason") is None
    )
    return not announces_role_only


def _choice_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def normalize_timings(raw: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in raw.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[_TIMING_ALIASES.get(k, k)] = float(v)
    return out


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    req: BenchRequest,
    payload: dict[str, Any],
    *,
    group: str,
    endpoint: str,
    t0: float,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """POST one streaming request and time it; never raises for request errors (they go in .error)."""
    rec = RequestRecord(
        id=req.id, group=group, bucket=req.bucket, output_len=req.output_len, prompt_tokens=req.prompt_tokens,
        exact_len=req.body is None,
    )
    chars = 0
    st = time.perf_counter()
    rec.start_s = st - t0
    last = st
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (": ping"), event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return rec
                choices = chunk.get("choices") or []
                if choices and _is_token_chunk(choices[0], endpoint):
                    if rec.ttft_s is None:
                        rec.ttft_s = now - st
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.chunk_tokens.append(_chunk_token_count(choices[0]))
                    chars += len(_choice_text(choices[0], endpoint))
                for c in choices:
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    if usage.get("completion_tokens") is not None:
                        rec.output_tokens = int(usage["completion_tokens"])
                        rec.output_tokens_source = "usage"
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                if isinstance(chunk.get("timings"), dict):
                    rec.server_timings = normalize_timings(chunk["timings"])
    except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.text_chars = chars
    if rec.ttft_s is None:
        rec.error = "no token-bearing chunk received"
        return rec
    rec.e2e_s = last - st
    if rec.output_tokens is None:
        rec.output_tokens = sum(rec.chunk_tokens)
        rec.output_tokens_source = "chunks"
    rec.ok = True
    return rec
