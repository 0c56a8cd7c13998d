"""Every request field vLLM 0.32 takes on /v1/completions and /v1/chat/completions is either built (a 200
whose answer it shaped) or refused with a 400 that names it: never accepted and dropped. Sent through the
official openai client (extra_body), to the real server; the sampling controls' effect through the server."""

from __future__ import annotations

import openai
import pytest

from leverlab.server import fields

MODEL = "tiny-qwen3"
CHAT = [{"role": "user", "content": "hi"}]

# vLLM 0.32.0's request fields (CompletionRequest / ChatCompletionRequest .model_fields), with a value that
# asks for something. Listed here, not imported: vLLM is not installed where the tests run.
COMPLETION = {
    "add_special_tokens": False, "allowed_token_ids": [5, 6], "bad_words": ["x"], "cache_salt": "s",
    "ec_transfer_params": {"a": 1}, "echo": True, "frequency_penalty": 0.5, "ignore_eos": True,
    "include_stop_str_in_output": True, "kv_transfer_params": {"a": 1}, "length_penalty": 0.5,
    "logit_bias": {"5": 2.0}, "logprob_token_ids": [1], "logprobs": 1, "max_tokens": 2, "min_p": 0.1,
    "min_tokens": 1, "mm_payload": "none", "model": MODEL, "n": 1, "presence_penalty": 0.5, "priority": 3,
    "prompt": "hi", "prompt_embeds": "AAAA", "prompt_logprobs": 1, "repetition_detection": {"x": 1},
    "repetition_penalty": 1.2, "request_id": "mine", "response_format": {"type": "json_object"},
    "return_mm_kwargs": True, "return_token_ids": True, "return_token_offsets": True,
    "return_tokens_as_token_ids": True, "routed_experts_prompt_start": 2, "seed": 1, "session_id": "s",
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "stop": ["\n"],
    "stop_token_ids": [3], "stream": False, "stream_interval": 4, "stream_options": None,
    "structured_outputs": {"regex": "a+"}, "suffix": "end", "temperature": 0.5, "thinking_token_budget": 5,
    "top_k": 3, "top_p": 0.9, "truncate_prompt_tokens": 4, "truncation_side": "left", "use_beam_search": True,
    "user": "u", "vllm_xargs": {"a": 1}, "watermarking": True,
}
CHAT_FIELDS = {
    **{k: v for k, v in COMPLETION.items()
       if k not in ("echo", "logprobs", "prompt", "suffix", "max_tokens", "add_special_tokens")},
    "add_generation_prompt": True, "add_special_tokens": True, "chat_template": None,
    "chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": False,
    "documents": [{"title": "t", "text": "x"}], "echo": True, "include_reasoning": False, "logprobs": True,
    "max_completion_tokens": 2, "max_tokens": 2, "media_io_kwargs": {"a": {}}, "messages": CHAT,
    "mm_processor_kwargs": {"a": 1}, "parallel_tool_calls": False, "reasoning_effort": "low",
    "return_prompt_text": True, "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "top_logprobs": 2,
}
# built: a 200 (with the value above). Everything else must be a 400 naming the field.
BUILT = {
    "allowed_token_ids", "bad_words", "echo", "frequency_penalty", "ignore_eos", "include_stop_str_in_output",
    "logit_bias", "logprobs", "max_tokens", "min_p", "min_tokens", "model", "n", "presence_penalty",
    "prompt", "prompt_logprobs", "repetition_penalty", "return_token_ids", "return_tokens_as_token_ids", "seed",
    "skip_special_tokens", "stop", "stop_token_ids", "stream", "stream_options", "temperature", "top_k",
    "top_p", "user", "add_generation_prompt", "chat_template", "chat_template_kwargs",
    "continue_final_message", "include_reasoning", "max_completion_tokens", "messages", "top_logprobs",
    # structured output and tool calling (tests/server/test_structured.py); `tool_choice` without `tools` and
    # `tools` alone (tool_choice "auto" by default) on a server without --enable-auto-tool-choice are 400s, as vLLM's
    "response_format", "structured_outputs", "parallel_tool_calls",
}
CHAT_ONLY_REFUSED = {"echo", "return_tokens_as_token_ids"}  # built on completions, not (as vLLM's) on chat


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _send(client, chat: bool, name: str, value):
    base = {"model": MODEL, "max_tokens": 2}
    body = {**({"messages": CHAT} if chat else {"prompt": "hi"}), name: value}
    if name == "top_logprobs":
        body["logprobs"] = True
    create = client.chat.completions.create if chat else client.completions.create
    return create(**base, **{k: body.pop(k) for k in ("messages", "prompt") if k in body}, extra_body=body)


@pytest.mark.parametrize("chat,name", [(False, n) for n in COMPLETION] + [(True, n) for n in CHAT_FIELDS],
                         ids=[f"cmpl:{n}" for n in COMPLETION] + [f"chat:{n}" for n in CHAT_FIELDS])
def test_each_vllm_field_is_built_or_refused_by_name(client, chat, name):
    value = (CHAT_FIELDS if chat else COMPLETION)[name]
    built = name in BUILT and not (chat and name in CHAT_ONLY_REFUSED)
    if built:
        _send(client, chat, name, value)  # raises on any error status
        return
    with pytest.raises(openai.BadRequestError) as e:
        _send(client, chat, name, value)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    assert err.get("param") == name and name in err.get("message", ""), e.value.body


def test_older_structured_options_refused_and_neutral_values_pass(client):
    # vLLM <= 0.10's guided_* options beside the grammar: one engine here, JSON always compact
    for name in ("guided_decoding_backend", "guided_whitespace_pattern"):
        assert name in fields.UNBUILT_COMMON
        with pytest.raises(openai.BadRequestError, match=name):
            _send(client, True, name, "xgrammar")
    # a field sent with the value that asks for nothing (vLLM's default) is accepted, as vLLM clients do
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"priority": 0, "use_beam_search": False, "truncate_prompt_tokens": None})
    assert r.choices[0].text is not None


def test_unknown_field_refused_and_nested_too(client):
    with pytest.raises(openai.BadRequestError, match="max_token"):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"max_token": 3})
    with pytest.raises(openai.BadRequestError, match="include_usage_stats"):
        client.completions.create(model=MODEL, prompt="hi", stream=True,
                                  stream_options={"include_usage_stats": True})


def test_controls_shape_the_answer_through_the_server(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    ex = {"ignore_eos": True}
    free = client.completions.create(**kw, extra_body=ex).choices[0]
    allowed = list(range(100, 140))
    only = client.completions.create(**kw, extra_body={**ex, "allowed_token_ids": allowed, "return_token_ids": True})
    assert all(t in allowed for t in only.choices[0].token_ids)
    one = {**kw, "max_tokens": 1}
    top = client.completions.create(**one, logprobs=5, extra_body={**ex, "return_token_ids": True}).choices[0]
    first_id, second = top.token_ids[0], list(top.logprobs.top_logprobs[0])[1]  # chosen first, then the top 5
    banned = client.completions.create(**one, logit_bias={str(first_id): -100},
                                       extra_body={**ex, "return_token_ids": True}).choices[0]
    assert banned.token_ids[0] != first_id and banned.text == second
    pen = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={**ex, "repetition_penalty": 2.0}).choices[0]
    assert pen.text != free.text
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(**kw, extra_body={"allowed_token_ids": [10**6]})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(**kw, logit_bias={"99999999": 1})
