"""Which chat template renders a conversation: the server's (`--chat-template`, else the tokenizer's), and
a client's own only with `--trust-request-chat-template`, as vLLM does.

A Jinja template can loop and allocate without bound: one small unauthenticated request that brings its own
template could pin a core or exhaust memory. So a request's template (the `chat_template` field, or
`chat_template` inside `chat_template_kwargs`) is refused with a 400 unless the operator trusts clients.
Rendering always runs off the event loop (app.py), whichever template it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from leverlab.chat import RESERVED_KWARGS
from leverlab.server.protocol import BadRequest, ChatCompletionRequest


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding the template, or (as vLLM allows) the template text itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    if "{" in value:  # inline template text
        return value
    raise ValueError(f"--chat-template {value!r}: no such file (and not a template)")


@dataclass
class TemplatePolicy:
    server_template: str | None = None  # --chat-template; None: the tokenizer's own
    trust_request_templates: bool = False

    def template_for(self, req: ChatCompletionRequest) -> str | None:
        """The template to render `req` with (None: the tokenizer's); refuses a client's unless trusted."""
        kwargs = req.chat_template_kwargs or {}
        for key in RESERVED_KWARGS:  # apply_chat_template arguments the server sets itself
            if key in kwargs:
                raise BadRequest(f"chat_template_kwargs.{key} is set by the server; remove it",
                                 "chat_template_kwargs")
        requested = req.chat_template if req.chat_template is not None else kwargs.get("chat_template")
        if requested is None:
            return self.server_template
        if not self.trust_request_templates:
            raise BadRequest(
                "chat templates sent by the client are refused: this server renders its own template. "
                "The operator can allow them with --trust-request-chat-template.",
                "chat_template",
            )
        if not isinstance(requested, str) or not requested:
            raise BadRequest("chat_template must be a non-empty string", "chat_template")
        return requested
