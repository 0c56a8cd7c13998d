"""vLLM's `/tokenize` and `/detokenize`: the server's own tokenizer (and chat template) over HTTP.

    POST /tokenize   {"prompt": "text", "add_special_tokens": true}
                     or {"messages": [...], "add_generation_prompt": true}   (rendered as chat would be)
                  -> {"count": N, "max_model_len": L, "tokens": [...], "token_strs": null | [...]}
    POST /detokenize {"tokens": [...]} -> {"prompt": "text"}

Bodies are read and parsed as the completion routes' are (admission, off-loop parsing), and tokenizing runs
on a worker thread: a 1 MB text must not stall other streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from leverlab.server import responses as R
from leverlab.server.inputs import encode_chat
from leverlab.server.protocol import BadRequest, ChatCompletionRequest, ChatMessage, _Strict
from leverlab.server.state import ServerState, check_model, read_request, rejected


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_limits(self, limits: Any) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("send exactly one of prompt or messages", "prompt")
        size = len(self.prompt or "") + sum(len(str(m.content or "")) for m in self.messages or [])
        if size > limits.max_text_bytes:
            raise BadRequest(f"the text holds {size} characters: more than this model's context of "
                             f"{limits.max_model_len} tokens could ever hold", "prompt",
                             code="context_length_exceeded")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    def check_limits(self, limits: Any) -> None:
        bad = next((t for t in self.tokens if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is out of the vocabulary [0, {limits.vocab_size})", "tokens")


def add_routes(app: FastAPI, st: ServerState) -> None:
    engine = st.engine

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            req = await read_request(request, st, TokenizeRequest)
            check_model(st, req.model)
            loop = asyncio.get_running_loop()
            if req.messages is not None:
                chat = ChatCompletionRequest(
                    messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                    chat_template_kwargs=req.chat_template_kwargs)
                for i, m in enumerate(chat.messages):
                    m.check(i)
                template = st.templates.template_for(chat)
                ids = (await loop.run_in_executor(st.pool, encode_chat, engine, chat, template)).token_ids
            else:
                ids = await loop.run_in_executor(
                    st.pool, lambda: list(engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
            strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        except Exception as e:
            return rejected(st, e)
        return R.OpenAIJSON({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            req = await read_request(request, st, DetokenizeRequest)
            check_model(st, req.model)
            text = await asyncio.get_running_loop().run_in_executor(st.pool, engine.tokenizer.decode, req.tokens)
        except Exception as e:
            return rejected(st, e)
        return R.OpenAIJSON({"prompt": text})
