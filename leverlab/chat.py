"""A conversation rendered to prompt text by a chat template: the one renderer of the server's
/v1/chat/completions and of LLM.chat, so both build the same prompt from the same messages. Floor 0: it only
calls the tokenizer it is given, and the server (which meets the engine through EngineClient only) imports it.

Which template may run (the server refuses a client's own unless the operator trusts clients) is decided by
the caller; this module only renders. Errors are RequestError (the server answers 400) naming what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from leverlab.errors import RequestError

# apply_chat_template arguments that chat_template_kwargs must not set: the renderer sets them (tokenize would
# change the return type; the template is its own argument, governed by the caller).
RESERVED_KWARGS = ("tokenize", "return_dict", "return_tensors", "conversation", "messages")


def template_message(message: Mapping[str, Any], i: int = 0) -> dict[str, Any]:
    """One message as chat templates take it: content a string (text parts joined, None as ""), other keys
    (name, tool_calls, tool_call_id) kept. Only text content parts are built."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise RequestError(f"messages[{i}] must be a dict with a 'role' (and 'content'), got {message!r}",
                           f"messages.{i}")
    d = dict(message)
    content = d.get("content")
    if content is None:
        d["content"] = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                   f"supported, got type {kind!r}", f"messages.{i}.content")
            texts.append(part["text"])
        d["content"] = "".join(texts)
    elif not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts", f"messages.{i}.content")
    return d


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[Any] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                model_name: str = "this model") -> str:
    """The prompt text of `messages` (already template dicts: template_message) by `chat_template` (None: the
    tokenizer's own). Slow for a long conversation and unbounded for a hostile template: the server never
    calls this on its event loop."""
    kwargs = dict(chat_template_kwargs or {})
    for key in RESERVED_KWARGS:
        if key in kwargs:
            raise RequestError(f"chat_template_kwargs.{key} is set by the renderer; remove it", "chat_template_kwargs")
    kwargs.pop("chat_template", None)  # the caller chose the template (the server's trust policy)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"model {model_name!r} has no chat template in its tokenizer config; "
                           "use /v1/completions with a plain prompt instead", "messages")
    if add_generation_prompt and continue_final_message:
        raise RequestError("add_generation_prompt and continue_final_message cannot both be true: a final message "
                           "is either continued or answered", "continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            # the model's own template renders the tools (a template without tool support ignores them)
            **({"tools": tools} if tools else {}),
            **kwargs,
            **({"chat_template": chat_template} if chat_template is not None else {}),
        )
    except Exception as e:  # jinja TemplateError, raise_exception() in the template, bad kwargs
        raise RequestError(f"the chat template rejected these messages: {e}", "messages") from e
    if not isinstance(text, str) or not text:
        raise RequestError("the chat template rendered an empty prompt", "messages")
    return text
