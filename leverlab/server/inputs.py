"""Turning a request's prompt into token ids, and checking it fits, before the engine sees it.

The server tokenizes (and renders chat templates) itself, so every prompt reaches the engine as token ids
and every length problem is answered here with both numbers. The time spent is measured and added to the
engine's own tokenize time in the `timings` field.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from leverlab.chat import render_chat
from leverlab.engine.client import EnginePrompt, validate_prompt
from leverlab.errors import RequestError
from leverlab.server.body import Limits
from leverlab.server.protocol import BadRequest, ChatCompletionRequest


@dataclass
class Prompt:
    """A prompt as token ids, not yet checked against the context (`checked` makes the EnginePrompt)."""

    token_ids: list[int]
    text: str | None  # the prompt text where the request gave text (used by echo)
    tokenize_s: float  # server-side time: chat template + tokenizer


def vocab_size(engine: Any) -> int:
    """Token ids must be below this: the model's (possibly padded) vocabulary, as the engine reports it."""
    return int(engine.vocab_size)


def limits(engine: Any) -> Limits:
    """The checks that need no tokenizer (body.Limits), for this engine's model."""
    tok = engine.tokenizer
    try:
        longest = max(len(t) for t in tok.get_vocab())
    except Exception:  # a tokenizer without a vocabulary listing: assume long tokens
        longest = 64
    return Limits(engine.max_model_len, vocab_size(engine), 4 * max(1, longest))


def encode_prompt(engine: Any, prompt: str | list[int]) -> Prompt:
    t0 = time.perf_counter()
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        try:
            ids = list(engine.tokenizer.encode(prompt, add_special_tokens=True))
        except Exception as e:  # the tokenizer refused the text
            raise BadRequest(f"could not tokenize the prompt: {e}", "prompt") from e
        if not ids:
            raise BadRequest("prompt tokenizes to nothing; send some text", "prompt")
        return Prompt(ids, prompt, time.perf_counter() - t0)
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    return Prompt(list(prompt), None, time.perf_counter() - t0)  # the ids are checked once, by checked()


def encode_chat(engine: Any, req: ChatCompletionRequest, template: str | None = None) -> Prompt:
    """Render the conversation with `template` (None: the tokenizer's own; leverlab/chat.py, shared with
    LLM.chat) and tokenize it. Slow for a long conversation and unbounded for a hostile template: never call
    this on the event loop."""
    tok = engine.tokenizer
    t0 = time.perf_counter()
    try:
        text = render_chat(tok, req.template_messages(), chat_template=template,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, tools=req.tools,
                           chat_template_kwargs=req.chat_template_kwargs, model_name=engine.model_name)
    except RequestError as e:
        raise BadRequest(str(e), e.param) from e
    # The template already holds any special tokens (BOS, role markers): do not add them twice.
    ids = list(tok.encode(text, add_special_tokens=False))
    return Prompt(ids, text, time.perf_counter() - t0)


def checked(engine: Any, p: Prompt, max_tokens: int) -> EnginePrompt:
    """The prompt as the engine takes it: validated once, here (RequestError: 400 with both numbers)."""
    return validate_prompt(p.token_ids, max_tokens, vocab_size(engine), engine.max_model_len, p.text,
                           p.tokenize_s)


def default_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       param: str = "max_tokens", default: int | None = None) -> int:
    """The max_tokens a prompt runs with, by vLLM's rules: None means whatever room the context leaves after
    the prompt, or at most `default` (generation_config.json's max_new_tokens) when given; a number above the
    whole context is refused; any other is cut to that room (the answer ends with finish_reason "length"), so
    a client that always sends a generous max_tokens works with long prompts as it does against vLLM. A prompt that fills the context alone is refused."""
    room = max_model_len - prompt_len
    if room < 1:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens, and the prompt alone "
            f"takes {prompt_len} tokens. Please shorten the prompt.",
            "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(room, default)
    if requested > max_model_len:
        raise BadRequest(f"{param}={requested} cannot be greater than this model's maximum context length of "
                         f"{max_model_len} tokens; request fewer output tokens", param,
                         code="context_length_exceeded")
    return min(requested, room)
