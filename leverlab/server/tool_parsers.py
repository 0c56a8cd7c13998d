"""Tool-call parsers: model text -> OpenAI tool calls, by the name vLLM's --tool-call-parser takes.

A parser finds the calls in a finished text (`extract`) and, streaming, says how much of the text so far is
plain content that can go out now (`content_end`): text that might be the start of a call is held back.
Adding a format is a class and a line in PARSERS.
"""

from __future__ import annotations

import json
import re
from typing import Any


class HermesParser:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number,
    after optional content."""

    start, end = "<tool_call>", "</tool_call>"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content before the calls or None, [{"name", "arguments": JSON text}]). Text that does not parse
        as calls is all content, as in vLLM."""
        if self.start not in text:
            return text, []
        try:
            calls = []
            for closed, open_ in self._call.findall(text):
                obj = json.loads(closed or open_)
                calls.append({"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}),
                                                                           ensure_ascii=False)})
        except (ValueError, KeyError, TypeError):
            return text, []
        content = text[: text.find(self.start)]
        return content or None, calls

    def content_end(self, text: str) -> int:
        """How much of `text` (so far) is surely content: up to a call's start, or up to a tail that could
        still become one."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def complete_calls(self, text: str) -> int:
        """How many calls in `text` are closed (and can be sent whole while streaming)."""
        return text.count(self.end)


PARSERS = {"hermes": HermesParser}
