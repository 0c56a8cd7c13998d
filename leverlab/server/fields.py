"""Which request fields the server acts on, which it refuses, and the few it accepts and ignores.

Our rule: a field we do not implement is a 400 that names it, never silently dropped (a dropped
`guided_json` answers 200 with unconstrained text). The request models (protocol.py) declare every field
they build; anything else a body carries lands here:

  - UNBUILT: vLLM's request fields we do not implement, with the value that asks for nothing (vLLM's
    default). Sent with that value they are accepted (clients that serialize every field still work);
    any other value is refused.
  - IGNORED: OpenAI fields that cannot change the answer's tokens or text, accepted and ignored; each says
    why ignoring it is safe.
  - anything else: refused as unknown (a typo like `max_token` must not silently mean "16").
"""

from __future__ import annotations

from typing import Any

# vLLM 0.32's request fields that we do not implement -> the value that asks for nothing (vLLM's default).
_UNSET = object()  # no neutral value: any value is refused
UNBUILT_COMMON: dict[str, Any] = {
    "truncate_prompt_tokens": None,   # would cut the prompt; we refuse a too-long prompt instead
    "truncation_side": None,
    "priority": 0,                    # priority scheduling: our scheduler is first-come first-served
    "cache_salt": None,               # prefix-cache isolation per tenant: not built, so not pretended
    "kv_transfer_params": None,       # disaggregated prefill
    "ec_transfer_params": None,
    "use_beam_search": False,
    "length_penalty": 1.0,            # beam search only
    "prompt_embeds": None,
    "mm_payload": "tensors",          # multimodal: text-only models here
    "return_mm_kwargs": None,
    "logprob_token_ids": None,
    "repetition_detection": None,
    "routed_experts_prompt_start": 0,
    "session_id": None,
    "spaces_between_special_tokens": True,  # our detokenizer always joins special tokens as vLLM's default
    "stream_interval": None,          # we stream every step
    "thinking_token_budget": None,
    "vllm_xargs": None,
    "watermarking": None,
    "return_token_offsets": False,
    "request_id": _UNSET,             # vLLM takes the caller's id; ours are always generated
    # structured output's older options (vLLM <= 0.10): one grammar engine here, JSON always compact
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
}
UNBUILT_COMPLETION: dict[str, Any] = {
    **UNBUILT_COMMON,
    "add_special_tokens": True,       # completions always tokenize with the special tokens, as vLLM's default
}
UNBUILT_CHAT: dict[str, Any] = {
    **UNBUILT_COMMON,
    "add_special_tokens": False,      # the chat template carries them, as vLLM's default
    "echo": False,                    # vLLM's chat echo (of the last message)
    "documents": None,                # RAG documents for templates that take them
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "reasoning_effort": None,
    "return_prompt_text": None,
    "return_tokens_as_token_ids": None,  # built on completions only
}

# Accepted and ignored: none of these can change which tokens are generated or how they are detokenized.
IGNORED: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; it never reaches the model",
    "metadata": "key-value tags OpenAI stores with the request for the caller; nothing is stored here",
    "store": "whether OpenAI keeps the output for distillation/evals; this server keeps nothing",
    "safety_identifier": "OpenAI's successor of `user`, for abuse monitoring only",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; our prefix cache is exact and automatic",
    "service_tier": "OpenAI's latency/price tier; one tier here, and it changes latency, not the output",
}


def first_unbuilt(extra: dict[str, Any] | None, unbuilt: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first field of `extra` (the body's undeclared fields) that asks for something
    we do not do; None when every one is built-in-effect (neutral or ignored). The caller raises the 400."""
    for name, value in (extra or {}).items():
        if name in IGNORED:
            continue
        if name in unbuilt:
            neutral = unbuilt[name]
            if neutral is not _UNSET and value == neutral and isinstance(value, bool) == isinstance(neutral, bool):
                continue
            hint = "omit it" if neutral is _UNSET or neutral is None else f"omit it or set it to {neutral!r}"
            return name, f"{name} is not supported by this server; {hint}"
        return name, f"unknown field {name!r}: this server does not implement it; remove it"
    return None
