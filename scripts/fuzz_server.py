"""Fuzz a LeverLab server with seeded, generated requests: no answer may be a 5xx, the server must stay up,
and every KV block must be free at the end.

    python scripts/fuzz_server.py --requests 10000            # starts `leverlab serve` on the bundled model
    python scripts/fuzz_server.py --base-url http://127.0.0.1:8000 --requests 2000 --seed 7

Requests: valid completions and chats with random parameters; the same with one field set to a value of a
random wrong type or range, a field dropped or unknown fields added; broken bodies (truncated JSON, bad
UTF-8, lone surrogates, deep nesting, non-objects); wrong content types and methods; /tokenize and
/detokenize; streams read in full or cut after the first chunk. Prints the counts by status code.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from server_proc import free_port, stop, wait_ready  # noqa: E402

WEIRD = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 0.5, -0.0, 1e308, "", "x", "5",
         "NaN", [], [1], [[1]], {}, {"a": 1}, "\u0000", "😀" * 3, [None], list(range(50)), "a" * 5000]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
          "top_k", "seed", "stop", "stop_token_ids", "stream", "stream_options", "logprobs", "top_logprobs",
          "echo", "ignore_eos", "min_tokens", "prompt_logprobs", "presence_penalty", "logit_bias", "best_of",
          "chat_template_kwargs", "chat_template", "response_format", "tools", "suffix", "user",
          "skip_special_tokens", "return_tokens_as_token_ids", "include_stop_str_in_output"]


def valid_completion(rng: random.Random) -> dict:
    prompt = rng.choice([
        "def f(x):", "hello", " ".join(rng.choice(["a", "the", "if", "for", "x", "("]) for _ in range(rng.randint(1, 40))),
        [rng.randint(0, 300) for _ in range(rng.randint(1, 30))],
        ["a", "b c"], [[1, 2, 3], [4, 5]],
    ])
    body: dict = {"prompt": prompt, "max_tokens": rng.choice([1, 2, 3, 4, 8, None])}
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0, 0.5, 1.0, 1.5])
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.1, 0.9, 1.0])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 0, 1, 5])
    if rng.random() < 0.3:
        body["n"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", ["a", "b"], "x"])
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 2**32)
    if rng.random() < 0.1:
        body["echo"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if body["max_tokens"] is None:
        body["max_tokens"] = 4  # null fills the context: slow on the bundled model, kept for the mutations
    return body


def valid_chat(rng: random.Random) -> dict:
    msgs = [{"role": rng.choice(["user", "system", "assistant"]), "content": rng.choice(["hi", "write code", "", "x" * 50])}
            for _ in range(rng.randint(1, 4))]
    msgs[-1]["role"] = "user"
    body: dict = {"messages": msgs, "max_tokens": rng.choice([1, 2, 4])}
    if rng.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.2:
        body["n"] = rng.randint(1, 3)
    return body


def mutate(rng: random.Random, body: dict) -> dict:
    body = dict(body)
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.6:
            body[rng.choice(FIELDS)] = rng.choice(WEIRD)
        elif r < 0.8 and body:
            body.pop(rng.choice(list(body)))
        else:
            body[f"x_{rng.randint(0, 99)}"] = rng.choice(WEIRD)
    return body


def raw_body(rng: random.Random) -> bytes:
    good = json.dumps(valid_completion(rng)).encode()
    return rng.choice([
        good[: rng.randint(0, len(good))],
        b"\xff\xfe" + good,
        b'{"prompt": "\\ud800", "max_tokens": 1}',
        b"[" * 5000 + b"]" * 5000,
        b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b"null", b"[]", b'"str"', b"1e999999", b'{"prompt": "hi", "max_tokens": 1' + b"9" * 5000 + b"}",
        bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))),
        b'{"prompt": "x", "max_tokens": NaN}',
    ])


def make_request(rng: random.Random) -> tuple[str, str, dict, bytes | None, bool]:
    """(method, path, headers, body, cut): `cut` closes a stream after its first chunk."""
    json_h = {"content-type": "application/json"}
    r = rng.random()
    if r < 0.25:
        return "POST", "/v1/completions", json_h, json.dumps(valid_completion(rng)).encode(), rng.random() < 0.2
    if r < 0.35:
        return "POST", "/v1/chat/completions", json_h, json.dumps(valid_chat(rng)).encode(), rng.random() < 0.2
    if r < 0.65:
        base = valid_completion(rng) if rng.random() < 0.6 else valid_chat(rng)
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        return "POST", path, json_h, json.dumps(mutate(rng, base)).encode(), False
    if r < 0.78:
        return "POST", rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"]), json_h, raw_body(rng), False
    if r < 0.85:
        h = rng.choice([{"content-type": "text/plain"}, {}, {"content-type": "application/x-www-form-urlencoded"},
                        {"content-type": "application/json", "origin": "http://evil.example"}])
        return "POST", "/v1/completions", h, json.dumps(valid_completion(rng)).encode(), False
    if r < 0.93:
        if rng.random() < 0.5:
            body = rng.choice([{"prompt": "hello world"}, {"messages": [{"role": "user", "content": "hi"}]},
                               mutate(rng, {"prompt": "x"})])
            return "POST", "/tokenize", json_h, json.dumps(body).encode(), False
        body = rng.choice([{"tokens": [1, 2, 3]}, {"tokens": [10**9]}, mutate(rng, {"tokens": [5]})])
        return "POST", "/detokenize", json_h, json.dumps(body).encode(), False
    return rng.choice([("GET", "/v1/completions", {}, None, False), ("GET", "/nope", {}, None, False),
                       ("DELETE", "/v1/models", {}, None, False), ("GET", "/v1/models", {}, None, False),
                       ("GET", "/health", {}, None, False), ("GET", "/version", {}, None, False)])


async def send(client: httpx.AsyncClient, req) -> int:
    method, path, headers, body, cut = req
    try:
        async with client.stream(method, path, headers=headers, content=body) as r:
            if cut:
                async for _ in r.aiter_raw():
                    break
                return r.status_code
            await r.aread()
            return r.status_code
    except httpx.TimeoutException:
        return -1
    except httpx.HTTPError:
        return -2


async def run(base_url: str, total: int, seed: int, concurrency: int) -> collections.Counter:
    rng = random.Random(seed)
    reqs = [make_request(rng) for _ in range(total)]
    counts: collections.Counter = collections.Counter()
    bad: list = []
    it = iter(reqs)

    async def worker(client: httpx.AsyncClient) -> None:
        for req in it:
            code = await send(client, req)
            counts[code] += 1
            if code >= 500 or code < 0:
                bad.append((code, req[0], req[1], (req[3] or b"")[:200]))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    for b in bad[:10]:
        print("BAD", b)
    return counts


def start_server(model: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # A 512-token context: a chat that lost its max_tokens fills the context, and on the bundled model's 4096
    # that takes minutes; what is fuzzed is the request handling, not long generations.
    cmd = [sys.executable, "-m", "leverlab.cli", "serve", *([model] if model else []), "--port", str(port),
           "--disable-log-requests", "--max-model-len", "512"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.devnull, "w"))
    if not wait_ready(proc, port, 300):
        code = proc.poll()
        stop(proc)
        raise SystemExit(f"server exited with {code}" if code is not None else "server did not start")
    return proc, f"http://127.0.0.1:{port}"


def kv_blocks_used(url: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("leverlab_kv_blocks_used "):
            return float(line.split()[1])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--model", default=None, help="model for the server it starts (default: the bundled one)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args.model)
    try:
        t0 = time.monotonic()
        counts = asyncio.run(run(url, args.requests, args.seed, args.concurrency))
        dt = time.monotonic() - t0
        alive = httpx.get(url + "/health", timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while (used := kv_blocks_used(url)) not in (0, None) and time.monotonic() < deadline:
            time.sleep(0.2)
        fivexx = sum(v for k, v in counts.items() if k >= 500 or k < 0)
        print(json.dumps({"requests": sum(counts.values()), "seconds": round(dt, 1), "seed": args.seed,
                          "status_counts": {str(k): v for k, v in sorted(counts.items())},
                          "5xx_or_failed": fivexx, "alive": alive, "kv_blocks_used_after": used}))
        return 0 if fivexx == 0 and alive and not used else 1
    finally:
        if proc is not None:
            stop(proc, grace_s=60)


if __name__ == "__main__":
    sys.exit(main())
