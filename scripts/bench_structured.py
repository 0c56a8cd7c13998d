"""Structured output's cost and jump-forward's gain, on the bundled model, in one run with interleaved rounds.

The agent workload's requests (leverlab/bench/agent.py, from models/workload.json's chat prompts): half ask for a
tool call (the grammar tool_choice "required" imposes: an array of {"name", "parameters"}), half for a JSON-schema
answer, driven through the Python API (no HTTP) so that only the engine differs. Three modes, each round in turn:
  free         the same prompts unconstrained, each held to the token count its constrained answer had
               (ignore_eos), so the grammar's own cost is what differs
  constrained  the grammar's masks, jump-forward off (--no-structured-outputs-jump-forward)
  jump-forward the grammar's masks, forced tokens appended without a decode pass each (the default)
End-to-end latency (arrival to finish, per request) at concurrency 1 (one request at a time) and 16 (16 at
once); the prefix cache is reset before each measurement.

    python scripts/bench_structured.py [--rounds 3] [--requests 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from leverlab import LLM, SamplingParams, StructuredOutputsParams
from leverlab.bench import agent
from leverlab.server.tools import plan_tools

ROOT = Path(__file__).resolve().parents[1]
# the grammar the server imposes on the agent workload's tool-call requests (tool_call_body: required, one call)
TOOL_SCHEMA = plan_tools(agent.TOOLS, "required", False, None, parallel_tool_calls=False).schema()
REVIEW_SCHEMA = agent.REVIEW


def prompts(tokenizer, n: int) -> list[tuple[list[int], dict]]:
    chats = json.loads((ROOT / "models" / "workload.json").read_text())["chat"]
    out = []
    for i in range(n):
        msgs = chats[i % len(chats)]["messages"]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append((ids, TOOL_SCHEMA if i % 2 == 0 else REVIEW_SCHEMA))
    return out


def run(llm: LLM, reqs, concurrency: int, lengths: list[int] | None) -> tuple[list[float], list[int]]:
    """Latencies (s) and output lengths; lengths given: free text of those lengths."""
    llm.engine.reset_prefix_cache()
    lat, lens = [], []
    for start in range(0, len(reqs), concurrency):
        chunk = reqs[start:start + concurrency]
        params = []
        for j, (_, schema) in enumerate(chunk):
            if lengths is None:
                params.append(SamplingParams(temperature=0, max_tokens=agent.MAX_TOKENS,
                                             structured_outputs=StructuredOutputsParams(json=schema)))
            else:
                params.append(SamplingParams(temperature=0, max_tokens=lengths[start + j], ignore_eos=True))
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in chunk], params)
        for o in outs:
            lat.append(o.metrics.finished_time - o.metrics.arrival_time)
            lens.append(len(o.outputs[0].token_ids))
    return lat, lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    plain = LLM(dtype=args.dtype, structured_outputs_jump_forward=False)
    jf = LLM(dtype=args.dtype, structured_outputs_jump_forward=True)
    reqs = prompts(plain.engine.tokenizer, args.requests)
    lengths, _ = None, None
    _, lengths = run(plain, reqs, 16, None)  # warm-up, and the constrained answers' lengths
    modes = {"free": (plain, lengths), "constrained": (plain, None), "jump-forward": (jf, None)}
    res: dict[tuple[str, int], list[float]] = {}
    t0 = time.monotonic()
    for _ in range(args.rounds):
        for c in (1, 16):
            for name, (llm, lens) in modes.items():
                lat, got = run(llm, reqs, c, lens)
                if lens is None:
                    assert got == lengths, "constrained decoding must give the same tokens in every mode"
                res.setdefault((name, c), []).extend(lat)
    print(f"bundled model, {args.dtype}, {args.requests} requests (tool calls and JSON schemas), "
          f"{sum(lengths)} output tokens each pass, {args.rounds} interleaved rounds, {time.monotonic() - t0:.0f} s")
    print(f"{'concurrency':>11} {'mode':>13} {'P50 e2e ms':>11} {'mean e2e ms':>12} {'vs free':>8} {'vs constrained':>15}")
    for c in (1, 16):
        base = {m: statistics.mean(res[(m, c)]) for m in modes}
        for m in modes:
            v = res[(m, c)]
            print(f"{c:>11} {m:>13} {statistics.median(v) * 1e3:>11.1f} {base[m] * 1e3:>12.1f} "
                  f"{base[m] / base['free']:>8.3f} {base[m] / base['constrained']:>15.3f}")
    plain.close()
    jf.close()


if __name__ == "__main__":
    main()
