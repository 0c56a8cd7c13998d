"""The `agent` workload: the traffic of an agent loop, built from the bundled prompt set's chat prompts.

Each request is a chat turn whose answer must be machine-readable: even-numbered ones a tool call (`tools` with
`tool_choice: "required"`, one call: `parallel_tool_calls: false`), odd-numbered ones a JSON-schema answer
(`response_format`). The schemas name their keys and enum values in full, so a grammar forces many tokens:
what jump-forward (--structured-outputs-jump-forward) skips. A request ends where its grammar does, so its
output length is a cap (max_tokens), not exact: the harness sends no ignore_eos for it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from leverlab.bench.records import BenchRequest

BUCKET = "agent"
MAX_TOKENS = 256  # above any answer these schemas allow (~70 tokens on the bundled tokenizer, ~200 on a byte-level one)

READ_FILE = {"type": "object", "additionalProperties": False, "required": ["path", "start_line"],
             "properties": {"path": {"type": "string", "maxLength": 24},
                            "start_line": {"type": "integer", "minimum": 1, "maximum": 9999}}}
RUN_TESTS = {"type": "object", "additionalProperties": False, "required": ["test_module"],
             "properties": {"test_module": {"type": "string", "maxLength": 24}}}
TOOLS = [
    {"type": "function", "function": {"name": "read_source_file", "description": "Read a source file from a line on",
                                      "parameters": READ_FILE}},
    {"type": "function", "function": {"name": "run_python_tests", "description": "Run one test module",
                                      "parameters": RUN_TESTS}},
]
REVIEW = {"type": "object", "additionalProperties": False,
          "required": ["function_name", "complexity_rating", "has_side_effects", "summary_of_behaviour"],
          "properties": {"function_name": {"type": "string", "maxLength": 20},
                         "complexity_rating": {"type": "string", "enum": ["trivial", "moderate", "complicated"]},
                         "has_side_effects": {"type": "boolean"},
                         "summary_of_behaviour": {"type": "string", "maxLength": 40}}}


def tool_call_body() -> dict[str, Any]:
    return {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}


def json_schema_body() -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": REVIEW}}}


def agent_requests(workload_file: Path, num_prompts: int | None, seed: int) -> list[BenchRequest]:
    chats = json.loads(Path(workload_file).read_text()).get("chat") or []
    if not chats:
        raise ValueError(f"{workload_file} has no chat prompts for the agent workload")
    n = num_prompts or len(chats)
    order = list(range(len(chats)))
    random.Random(f"{seed}/{BUCKET}").shuffle(order)
    reqs = []
    for i in range(n):
        chat = chats[order[i % len(chats)]]
        body = tool_call_body() if i % 2 == 0 else json_schema_body()
        reqs.append(BenchRequest(id=f"{BUCKET}-{i:03d}", bucket=BUCKET, output_len=MAX_TOKENS,
                                 messages=chat["messages"], source=chat.get("source"), body=body))
    return reqs
