"""`--reasoning-parser qwen3 | deepseek_r1`: a chat answer's `<think>...</think>` text goes to
`reasoning_content`, the rest stays in `content`, streamed or not.

Both parsers follow vLLM 0.32's, found by running them on the same texts (docs/serving.md):
  - the answer starts in reasoning, with or without a `<think>` (templates such as DeepSeek-R1's and Qwen3's
    put the start tag in the prompt); `<think>` tags inside reasoning are dropped; the first `</think>` ends
    it. No `</think>` at all: everything is reasoning and content is null. Empty content is null (and so is
    empty reasoning under qwen3).
  - qwen3: `chat_template_kwargs.enable_thinking: false` turns the parser off for the request (the whole text
    is content, tags and all); a later stray `</think>` in the content is dropped.
  - deepseek_r1: enable_thinking is not read; a later `</think>` stays in the content. (vLLM's also drops
    text before a `<think>` that is not at the start, unstreamed only; ours keeps it as reasoning, as its
    stream does.)

The tags are matched in the text, not by token id: a model whose tokenizer has them as single tokens and one
that spells them in pieces (the bundled model) parse the same. Streaming holds back the tail of a delta that
could be the start of a tag until the next delta shows whether it is, so a tag split across chunks is still
recognised and never leaks; what the stream sends concatenates to what the non-streamed answer holds.

The reply carries the reasoning under both `reasoning_content` (the name in this issue, DeepSeek's API,
llama-server and vLLM before 0.10) and `reasoning` (vLLM 0.32's name), so clients of either read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"--reasoning-parser {self.name!r}: not one of {', '.join(PARSERS)}")

    def for_request(self, chat_template_kwargs: dict[str, Any] | None) -> ReasoningParser | None:
        """The parser for one request, None where it is off (qwen3 with enable_thinking false)."""
        if self.name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return None
        return self

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A finished answer -> (reasoning, content); empty content is None, and so is empty reasoning for
        qwen3 (deepseek_r1 keeps it as "", as vLLM's do)."""
        s = self.stream()
        r, c = s.feed(text, final=True)
        return (r or None) if self.name == "qwen3" else r, c or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(drop_late_end=self.name == "qwen3")


def message_fields(reasoning: str | None, content: str | None, include: bool = True,
                   delta: bool = False) -> dict[str, Any]:
    """The message (or, `delta`, a stream delta's) keys of a split answer: a message always has the reasoning
    keys (null when none), a delta only when it carries reasoning; `include` false (vLLM's include_reasoning)
    drops them."""
    out: dict[str, Any] = {}
    if include and (reasoning is not None or not delta):
        out["reasoning_content"] = out["reasoning"] = reasoning
    out["content"] = content
    return out


@dataclass
class ReasoningStream:
    """One choice's incremental split: feed(delta) -> (reasoning delta, content delta)."""

    drop_late_end: bool
    in_reasoning: bool = True
    pending: str = ""  # a tail held back: it may be the start of a tag

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.pending += delta
        out = ["", ""]  # reasoning, content
        while True:
            tags = (START, END) if self.in_reasoning else ((END,) if self.drop_late_end else ())
            hits = [(self.pending.find(t), t) for t in tags]
            hits = [(i, t) for i, t in hits if i >= 0]
            where = 0 if self.in_reasoning else 1
            if hits:
                i, tag = min(hits)
                out[where] += self.pending[:i]
                self.pending = self.pending[i + len(tag):]
                if tag == END:
                    self.in_reasoning = False
                continue
            keep = 0 if final else _partial_tag_tail(self.pending, tags)
            out[where] += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return out[0], out[1]


def _partial_tag_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags` (0: none)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
