"""A stand-in OpenAI-compatible server with known, deterministic delays: the one place a fake server is
right, because the harness's expected figures must be known exactly.

Each prompt may carry a directive, e.g. "[ttft=120 itl=20 pack=2 fail=0 tail=0]": ms to the first chunk,
ms between chunks, tokens per SSE chunk, an HTTP status to fail with, ms between the last token and the usage
chunk. Chunk k (0-based) is due at arrival + ttft + k * itl, scheduled from the request's arrival so sleep
jitter does not accumulate; since a loaded machine wakes sleeps late, the usage chunk's `timings` also says
when the first and last chunks actually went out (first_sent_ms, last_sent_ms, from arrival). The output
length is always max_tokens (as with ignore_eos). Chat streams first announce the role at once, before any
token, as some servers do.

Run: python tests/bench/fake_server.py PORT
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

DIRECTIVE = re.compile(r"\[([^\]]*)\]")
COUNTERS = {"requests": 0, "tokens": 0, "hits": 0}


def directive(text: str) -> dict[str, float]:
    out = {"ttft": 50.0, "itl": 10.0, "pack": 1.0, "fail": 0.0, "tail": 0.0}
    m = DIRECTIVE.search(text)
    if m:
        for part in m.group(1).split():
            k, _, v = part.partition("=")
            out[k] = float(v)
    return out


async def models(_: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "root": "fake"}]})


async def version(_: Request) -> JSONResponse:
    return JSONResponse({"version": "0.0-fake", "levers": {"quantization": None, "speculative": None}})


async def metrics(_: Request) -> PlainTextResponse:
    c = COUNTERS
    return PlainTextResponse(
        "# HELP fake_requests_total requests\n# TYPE fake_requests_total counter\n"
        f"fake_requests_total {c['requests']}\n"
        "# TYPE fake_prefix_cache_queries_total counter\n"
        f"fake_prefix_cache_queries_total {c['tokens']}\n"
        "# TYPE fake_prefix_cache_hits_total counter\n"
        f"fake_prefix_cache_hits_total {c['hits']}\n"
        "# TYPE fake_running gauge\nfake_running 0\n"
        "# TYPE fake_e2e_seconds histogram\n"
        f'fake_e2e_seconds_bucket{{le="+Inf"}} {c["requests"]}\n'
        f"fake_e2e_seconds_sum {c['requests'] * 0.5}\nfake_e2e_seconds_count {c['requests']}\n"
    )


async def _generate(request: Request, chat: bool):
    t_arrive = time.perf_counter()
    body = await request.json()
    text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
    d = directive(text)
    if d["fail"]:
        return JSONResponse({"error": {"message": "told to fail"}}, status_code=int(d["fail"]))
    n = int(body["max_tokens"])
    pack = max(1, int(d["pack"]))
    chunks = [list(range(i, min(i + pack, n))) for i in range(0, n, pack)]
    COUNTERS["requests"] += 1
    COUNTERS["tokens"] += 10
    COUNTERS["hits"] += 4
    obj = "chat.completion.chunk" if chat else "text_completion"

    def sse(payload: dict) -> str:
        return "data: " + json.dumps({"id": "x", "object": obj, "model": "fake-model", **payload}) + "\n\n"

    async def stream():
        if chat:
            yield sse(
                {
                    "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    ]
                }
            )
        sent = []  # when each chunk actually went out, ms from arrival (sleeps can wake late)
        for k, toks in enumerate(chunks):
            due = t_arrive + (d["ttft"] + k * d["itl"]) / 1000
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append((time.perf_counter() - t_arrive) * 1000)
            piece = "".join(f" t{t}" for t in toks)
            fin = "length" if k == len(chunks) - 1 else None
            choice = {"index": 0, "finish_reason": fin}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            yield sse({"choices": [choice]})
        if d["tail"]:  # a server that takes a while to send usage and [DONE] after the last token
            await asyncio.sleep(d["tail"] / 1000)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse(
                {
                    "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7},
                    "timings": {
                        "tokenize_ms": 1.0,
                        "queue_ms": 2.0,
                        "prefill_ms": d["ttft"] - 3.0,
                        "decode_ms": d["itl"] * (len(chunks) - 1),
                        "detokenize_ms": 0.5,
                        # what the server actually did, so tests can tell its lateness from the client's
                        "first_sent_ms": sent[0],
                        "last_sent_ms": sent[-1],
                    },
                }
            )
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def completions(request: Request):
    return await _generate(request, chat=False)


async def chat_completions(request: Request):
    return await _generate(request, chat=True)


app = Starlette(
    routes=[
        Route("/v1/models", models),
        Route("/version", version),
        Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
