"""Tool calling as vLLM does it: `tools` and `tool_choice` on chat requests.

  none       tools are rendered by the chat template; the answer is plain content
  auto       (needs --enable-auto-tool-choice --tool-call-parser P) the model decides; the parser finds calls
             in its text, finish_reason "tool_calls" when it made some
  required   the grammar engine constrains the output to a JSON array of {"name", "parameters"} (one of the
             tools each, parameters valid under that tool's schema), parsed into tool_calls
  named      the output is constrained to the named function's parameters schema: that is the call's arguments
             (finish_reason stays "stop", as in OpenAI's API and vLLM)

Streaming sends content as it comes and each tool call whole once it is complete (vLLM also streams a call's
arguments in pieces); concatenating the deltas gives the same calls as the full response.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from leverlab.server.protocol import BadRequest
from leverlab.server.tool_parsers import PARSERS


def _call_id() -> str:
    return "chatcmpl-tool-" + secrets.token_hex(16)


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]
    name: str | None = None  # named mode
    parser: Any = None  # auto mode
    parallel: bool = True  # parallel_tool_calls: false allows one call (required: the array's maxItems)

    def schema(self) -> dict | None:
        """The JSON schema the output must follow (required, named), else None."""
        if self.mode == "named":
            return _params(next(t for t in self.tools if t["function"]["name"] == self.name))
        if self.mode != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _params(t)},
                  "required": ["name", "parameters"],
                  # (vLLM's leaves other keys open: a model can then add keys until max_tokens)
                  "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def calls_in(self, text: str, final: bool) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, [{"name", "arguments"}]) from the output so far (final: the whole of it)."""
        if self.mode == "named":
            return None, ([{"name": self.name, "arguments": text}] if final else [])
        if self.mode == "required":
            if not final:
                return None, []
            try:
                items = json.loads(text)
                return None, [{"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}
                              for c in items]
            except (ValueError, KeyError, TypeError):  # cut by max_tokens or a stop string
                return text, []
        if self.mode == "auto":
            return self.parser.extract(text)
        return text, []

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The full response's message and finish_reason."""
        content, calls = self.calls_in(text, final=True)
        if self.mode == "none" or (self.mode == "auto" and not calls):
            return {"role": "assistant", "content": text}, finish_reason
        msg = {"role": "assistant", "content": content if self.mode == "auto" else (content or ""),
               "tool_calls": [_tool_call(c) for c in calls]}
        if self.mode == "named" or finish_reason != "stop":
            return msg, finish_reason
        return msg, "tool_calls"


def _tool_call(c: dict[str, Any]) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}


def _params(tool: dict[str, Any]) -> dict:
    p = tool["function"].get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object", "properties": {}}


@dataclass
class ToolStream:
    """One streamed choice's tool-call state: what content and which calls were sent."""

    plan: ToolPlan
    content_sent: int = 0
    calls_sent: int = 0
    ids: list[str] = field(default_factory=list)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta's fields ("content", "tool_calls") for the output text so far."""
        out: dict[str, Any] = {}
        p = self.plan
        if p.mode == "none" or (p.mode == "auto" and p.parser is None):
            out["content"] = text[self.content_sent:]
            self.content_sent = len(text)
            return out
        if p.mode == "auto":
            end = len(text) if final and p.parser.start not in text else p.parser.content_end(text)
            if end > self.content_sent:
                out["content"] = text[self.content_sent:end]
                self.content_sent = end
            if not final and p.parser.complete_calls(text) <= self.calls_sent:
                return out
        elif p.mode == "named" and not final:
            # the call's name first, then the arguments as they come
            if self.calls_sent == 0:
                self.ids.append(_call_id())
                self.calls_sent = 1
                out["tool_calls"] = [{"index": 0, "id": self.ids[0], "type": "function",
                                      "function": {"name": p.name, "arguments": text}}]
                self.content_sent = len(text)
            elif len(text) > self.content_sent:
                out["tool_calls"] = [{"index": 0, "function": {"arguments": text[self.content_sent:]}}]
                self.content_sent = len(text)
            return out
        if p.mode == "named":  # final: whatever of the arguments is not sent yet
            return self.delta(text, final=False)
        if not final and p.mode == "required":
            return out
        _, calls = p.calls_in(text if final or p.mode != "auto" else _closed(text, p.parser), final=True)
        new = calls[self.calls_sent:]
        if new:
            out["tool_calls"] = [{"index": self.calls_sent + i, "id": _call_id(), "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(new)]
            self.calls_sent += len(new)
        elif final and not calls and not self.calls_sent and len(text) > self.content_sent:
            # no valid calls after all (cut short, or not JSON): the rest is content, as in the full response
            out["content"] = out.get("content", "") + text[self.content_sent:]
            self.content_sent = len(text)
        return out

    def finish_reason(self, finish: str | None) -> str | None:
        if finish == "stop" and self.calls_sent and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return finish


def _closed(text: str, parser) -> str:
    """The text up to the end of its last closed call."""
    return text[: text.rfind(parser.end) + len(parser.end)]


def plan_tools(tools: list[Any] | None, tool_choice: Any, enable_auto: bool, parser_name: str | None,
               parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """Check `tools` / `tool_choice` as vLLM does and say what to do; None when the request has no tools."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise BadRequest("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                         "entirely.", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "{...}}}}", f"tools.{i}")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", f"tools.{i}")
        names.append(f["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel_tool_calls is not False)
    if choice == "auto":
        if not enable_auto or parser_name is None:
            # (named after what the client sent: `tools` alone mean "auto")
            raise BadRequest('"auto" tool choice (the default with `tools`) requires --enable-auto-tool-choice and '
                             "--tool-call-parser to be set", "tools" if tool_choice is None else "tool_choice")
        return ToolPlan("auto", tools, parser=PARSERS[parser_name]())
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(f"Invalid value for `tool_choice`: {choice!r}! Only named tools, \"none\", \"auto\" or "
                         "\"required\" are supported. Correct usage: "
                         '`{"type": "function", "function": {"name": "my_function"}}`', "tool_choice")
    if fn["name"] not in names:
        raise BadRequest(f"Tool '{fn['name']}' has not been passed in `tools`.", "tool_choice")
    return ToolPlan("named", tools, name=fn["name"])
