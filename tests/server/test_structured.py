"""Structured output and tool calls through real servers and the official openai client (issue 59).

JSON-schema answers validate (jsonschema) for greedy and sampled decoding, without speculation and with
n-gram and EAGLE drafts verified under the grammar's masks (greedy: the same tokens); tool_choice required and
named return calls whose arguments validate; a streamed call's deltas concatenate to the full response's call;
hermes auto tool calls are parsed; bad grammars are 400s; every KV block is free afterwards.
"""

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.checkpoints import make_eagle_head

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query", "limit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "search", "parameters": SEARCH}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def spec_servers(start_server, checkpoint, tmp_path_factory):
    head = make_eagle_head(checkpoint, tmp_path_factory.mktemp("head") / "head")
    servers = {
        "ngram": start_server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_min": 1}'),
        "eagle": start_server("--speculative-config",
                              json.dumps({"method": "eagle", "model": head, "num_speculative_tokens": 3})),
    }
    yield servers
    for s in servers.values():
        s.stop()


def _json_answers(srv) -> tuple[list[str], list[str]]:
    c = _client(srv)
    model = c.models.list().data[0].id
    greedy = c.chat.completions.create(model=model, messages=MESSAGES, response_format=FORMAT, temperature=0,
                                       max_tokens=120, n=1)
    sampled = c.chat.completions.create(model=model, messages=MESSAGES, response_format=FORMAT, temperature=1.0,
                                        seed=7, max_tokens=120, n=3)
    comp = c.completions.create(model=model, prompt=["def add(a, b):", "Hello"], max_tokens=120, temperature=0,
                                extra_body={"structured_outputs": {"json": SCHEMA}})
    texts = [ch.message.content for ch in greedy.choices] + [ch.text for ch in comp.choices]
    for ch in [*greedy.choices, *sampled.choices, *comp.choices]:
        assert ch.finish_reason == "stop"
    for t in texts + [ch.message.content for ch in sampled.choices]:
        jsonschema.validate(json.loads(t), SCHEMA)
    return texts, [ch.message.content for ch in sampled.choices]


def test_json_schema_validates_with_and_without_speculation(server, spec_servers):
    plain, _ = _json_answers(server)
    for name, srv in spec_servers.items():
        greedy, _ = _json_answers(srv)
        assert greedy == plain, name  # drafts verified under the mask: the same greedy tokens
        m = srv.metrics()
        assert m["leverlab_engine_spec_draft_tokens_total"] > 0, name
        assert srv.wait_idle()["leverlab_kv_blocks_used"] == 0
    assert server.wait_idle()["leverlab_kv_blocks_used"] == 0


def test_other_grammars_on_both_endpoints(server):
    c = _client(server)
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt="x", max_tokens=30, temperature=0.7, seed=1,
                             extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,5}"})
    assert r.choices[0].finish_reason == "stop"
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", r.choices[0].text)
    r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=1.0, n=4, seed=3,
                                  extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(ch.message.content in ("yes", "no", "maybe") for ch in r.choices)
    r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, temperature=0,
                                  response_format={"type": "json_object"})
    out = r.choices[0]  # (a random model may write one key until max_tokens: then it is cut, as any text)
    assert out.message.content.startswith("{") and (out.finish_reason == "length"
                                                      or isinstance(json.loads(out.message.content), dict))
    r = c.completions.create(model=model, prompt="x", max_tokens=20, temperature=0,
                             extra_body={"guided_grammar": 'start: "a" ("b" | "c")+ "!"'})
    assert re.fullmatch(r"a[bc]+!", r.choices[0].text) or r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param", [
    # grammars that do not compile are refused by the engine (the message names the kind)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     None),
    ({"guided_regex": "(unclosed"}, None),
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": TOOLS}, "tools"),  # auto (the default with tools) needs --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": "none"}, "tools"),
])
def test_bad_grammars_and_tool_choices_are_400s(server, body, param):
    c = _client(server)
    with pytest.raises(BadRequestError) as e:
        c.chat.completions.create(model=c.models.list().data[0].id, messages=MESSAGES, max_tokens=5,
                                  extra_body=body)
    if param:
        assert e.value.body["param"] == param
    assert server.metrics()["leverlab_num_requests_running"] == 0


def _stream_calls(c, model, **kw) -> tuple[dict, str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                d = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                d["id"] = d["id"] or tc.id
                d["name"] += tc.function.name or "" if tc.function else ""
                d["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, finish


def test_tool_choice_required_and_named(server):
    c = _client(server)
    model = c.models.list().data[0].id
    schemas = {"get_weather": WEATHER, "search": SEARCH}
    for temperature in (0, 1.0):
        r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                      temperature=temperature, seed=5, max_tokens=200, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "search"}}
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=0,
                                  max_tokens=100)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and [t.function.name for t in ch.message.tool_calls] == ["search"]
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), SEARCH)
    # Streamed: the deltas concatenate to the same calls as the full response (greedy).
    for choice in ("required", named):
        kw = dict(tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=200, parallel_tool_calls=False)
        full = c.chat.completions.create(model=model, messages=MESSAGES, **kw).choices[0]
        calls, finish = _stream_calls(c, model, **kw)
        assert finish == full.finish_reason
        assert [(d["name"], d["arguments"]) for _, d in sorted(calls.items())] == [
            (t.function.name, t.function.arguments) for t in full.message.tool_calls]
        assert all(d["id"] for d in calls.values())
    # tool_choice none: plain content, tools still rendered by the template
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None
    assert server.wait_idle()["leverlab_kv_blocks_used"] == 0


def test_hermes_auto_tool_calls(start_server):
    srv = start_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    c = _client(srv)
    model = c.models.list().data[0].id
    # A tiny random model never writes <tool_call> by itself: a regex makes it write one in Qwen's format,
    # after some content, and the auto parser must find it (full and streamed).
    regex = r'ok <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}\n</tool_call>'
    kw = dict(tools=TOOLS, temperature=0, max_tokens=80, extra_body={"guided_regex": regex})
    full = c.chat.completions.create(model=model, messages=MESSAGES, **kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == "ok "
    (call,) = full.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    calls, finish = _stream_calls(c, model, **kw)
    assert finish == "tool_calls"
    assert [(d["name"], d["arguments"]) for d in calls.values()] == [(call.function.name, call.function.arguments)]
    # without a call in the text: plain content
    r = c.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    srv.stop()


def test_agent_workload_through_the_harness(server, tmp_path):
    """`leverlab bench --workload agent --endpoint chat`: tool calls and JSON-schema answers, all valid."""
    from leverlab.bench import BenchConfig, run_benchmark

    res = run_benchmark(BenchConfig(base_url=server.url + "/v1", workload="agent", endpoint="chat", num_prompts=4,
                                    concurrency=[2], warmup=0, out_dir=str(tmp_path / "bench")))
    records = [json.loads(line) for line in (tmp_path / "bench" / "records.jsonl").read_text().splitlines()]
    assert records and all(r["ok"] for r in records), records[:2]
    assert {r["finish_reason"] for r in records} <= {"stop", "tool_calls"}, [(r["id"], r["finish_reason"], r["output_tokens"]) for r in records if r["finish_reason"] == "length"]
    assert all(g["output_len_mismatches"] == 0 for g in res.groups)
    assert server.wait_idle()["leverlab_kv_blocks_used"] == 0


@pytest.mark.parametrize("text", [
    'hi <tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
    'no call at all, a < sign and <tool',
    'cut short <tool_call>\n{"name": "search", "argu',
])
def test_hermes_stream_deltas_concatenate_to_the_full_message(text):
    """Fed one character at a time, the streamed content and calls equal the full response's."""
    from leverlab.server.tools import ToolStream, plan_tools

    plan = plan_tools(TOOLS, "auto", True, "hermes")
    msg, finish = plan.message(text, "stop")
    st, content, calls = ToolStream(plan), "", []
    for i in range(1, len(text) + 1):
        d = st.delta(text[:i], final=i == len(text))
        content += d.get("content") or ""
        calls += [(c["function"]["name"], c["function"]["arguments"]) for c in d.get("tool_calls", [])]
    assert content == (msg["content"] or "")
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    assert st.finish_reason("stop") == finish
