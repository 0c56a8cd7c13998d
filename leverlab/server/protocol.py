"""Request bodies of the OpenAI API (completions, chat), validated, and their mapping to SamplingParams.

Validation is strict on types (`"5"` is not an integer, `true` is not a number) and rejects NaN/Infinity,
so a wrong body becomes a 400 that names the field, never an exception deeper in the engine.
vLLM's extensions are accepted: `top_k`, `min_p`, the penalties, `logit_bias`, `bad_words`,
`allowed_token_ids`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `prompt_logprobs`, `return_token_ids`, (completions) `return_tokens_as_token_ids`, and
(chat) `add_generation_prompt`, `chat_template_kwargs`, `include_reasoning`. Structured output
(`response_format`, `structured_outputs`, `guided_*`) becomes SamplingParams.structured_outputs; tools:
server/tools.py.
Any other field is refused with a 400 naming it unless it asks for nothing (fields.py: vLLM's fields we do not
build, sent with their neutral value, and a few OpenAI fields that cannot change the output); vLLM itself
ignores unknown fields, we do not, so that nothing a client asked for is silently dropped.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from leverlab.chat import template_message
from leverlab.sampling_params import SamplingParams, StructuredOutputsParams
from leverlab.server.fields import UNBUILT_CHAT, UNBUILT_COMPLETION, first_unbuilt

MAX_STOP_SEQUENCES = 64
# Below this a temperature means greedy (vLLM's rule): logits / 1e-300 overflow to inf and sampling breaks.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_BATCH_PROMPTS = 64
# A signed 64-bit seed, as OpenAI clients send. The engine seeds choice i of n with seed + i, and torch takes
# at most 2**64 - 1, so seeds reach the engine folded into [0, 2**63): room for any n.
SEED_RANGE = (-(2**63), 2**63 - 1)


class BadRequest(ValueError):
    """A request the server refuses with a 4xx; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class _Strict(BaseModel):
    # Nested objects: an unknown key is a 400 from pydantic, naming it ("stream_options.x: Extra inputs ...")
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Body(BaseModel):
    # Request bodies keep unknown keys (model_extra) so that refuse_extra names them with a reason
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extension: with include_usage, every chunk carries the usage so far (not only the last one)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _CommonRequest(_Body):
    model: str | None = None  # None: the served model
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # None: the server's default (--generation-config), else vLLM's neutral value
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM extensions that benchmarks rely on for exact output lengths
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM extensions: logprobs of the prompt's own tokens (perplexity, drift between configurations); and
    # the generated (and prompt) token ids beside the text, so a client maps text back to exact tokens.
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    # Structured output (leverlab/structured/): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields; at most one of them per request
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _structured(self, tool_schema: dict | None = None) -> StructuredOutputsParams | None:
        """The one grammar this request asks for, or None; two at once is a 400 naming the second."""
        found: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise BadRequest("response_format json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if tool_schema is not None:
            found.append(("tool_choice", {"json": tool_schema}))
        if not found:
            return None
        if len(found) > 1:
            raise BadRequest(f"{found[1][0]} cannot be combined with {found[0][0]}: a request takes one grammar",
                             found[1][0])
        name, d = found[0]
        try:
            return StructuredOutputsParams.from_dict(d)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"{name}: {e}", name) from e

    def _check_stop_token_ids(self, vocab_size: int) -> None:
        bad = next((t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequest(f"stop_token_ids: token id {bad} is out of the vocabulary [0, {vocab_size})",
                             "stop_token_ids")
        if self.stop_token_ids:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # at most vocab_size entries now
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list(self.logit_bias or ()))):
            for t in ids:
                tid = _token_key(t)
                if tid is None or not 0 <= tid < vocab_size:
                    raise BadRequest(f"{name}: token id {t!r} is out of the vocabulary [0, {vocab_size})", name)

    UNBUILT: ClassVar[dict[str, Any]] = {}

    def refuse_extra(self) -> None:
        """A body field we do not declare is refused unless it asks for nothing (fields.py)."""
        found = first_unbuilt(self.model_extra, self.UNBUILT)
        if found is not None:
            raise BadRequest(found[1], found[0])

    def _refuse_unbuilt(self) -> None:
        """Fields whose effect we do not implement: refused when set to anything but their neutral value."""
        self.refuse_extra()
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(
                f"best_of ({self.best_of}) different from n ({self.n}) is not supported", "best_of"
            )
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         tool_schema: dict | None = None) -> SamplingParams:
        self._refuse_unbuilt()
        structured = self._structured(tool_schema)
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest("prompt_logprobs is returned only without streaming; set stream to false",
                             "prompt_logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise BadRequest(
                f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}", "stop"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise BadRequest(f"seed must be a 64-bit integer, got {self.seed}", "seed")
        seed = None if self.seed is None else self.seed % 2**63  # non-negative seeds pass unchanged
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        try:
            return SamplingParams(
                n=self.n,
                temperature=_temperature(self.temperature),
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=top_k,
                seed=seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                min_p=_or(self.min_p, 0.0),
                logit_bias=dict(self.logit_bias) if self.logit_bias else None,
                bad_words=list(self.bad_words) if self.bad_words else None,
                allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
                structured_outputs=structured,
            )
        except ValueError as e:
            # SamplingParams messages start with the field name ("top_p must be ...")
            msg = str(e)
            raise BadRequest(msg, msg.split(" ", 1)[0].rstrip(":")) from e


def _or(value: float | None, neutral: float) -> float:
    return neutral if value is None else value


def _token_key(t: Any) -> int | None:
    """A token id as JSON sends it: an int, or (logit_bias keys) a string of one; None when it is neither."""
    if isinstance(t, int) and not isinstance(t, bool):
        return t
    if isinstance(t, str) and t.strip().lstrip("-").isdigit():
        return int(t)
    return None


def _temperature(t: float | None) -> float:
    if t is None:
        return 1.0
    return 0.0 if 0.0 <= t < GREEDY_BELOW_TEMPERATURE else t


class CompletionRequest(_CommonRequest):
    prompt: Any = None  # str | list[int] | list[str] | list[list[int]]: checked by prompts()
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # vLLM extension: tokens shown as "token_id:N" so that a client compares exact ids rather than decoded pieces.
    return_tokens_as_token_ids: bool = False

    UNBUILT: ClassVar[dict[str, Any]] = UNBUILT_COMPLETION

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (lm-eval's loglikelihood requests): the prompt back, with its logprobs,
        and no generated text. As vLLM: the engine still runs one token (not shown, but counted in usage)."""
        return self.echo and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        """The max_tokens the engine runs with: the request's, 1 for echo_only."""
        return 1 if self.echo_only else self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """max_tokens: the request's, or (when it sent null) the room the context leaves, as vLLM does."""
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        params = self._sampling_params(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            # The echoed prompt's tokens get logprobs too (first one null): they come from prompt_logprobs,
            # which vLLM sets to `logprobs` unless the request set prompt_logprobs itself.
            if self.stream:
                raise BadRequest("echo with logprobs is returned only without streaming; set stream to false",
                                 "echo")
            if params.prompt_logprobs is None:
                params.prompt_logprobs = self.logprobs
        return params

    def check_limits(self, limits: Any) -> None:
        """What can never fit, refused before tokenizing (body.Limits): too many token ids or too much text
        for the context, stop_token_ids outside the vocabulary. Runs where the body was parsed (maybe another
        process), so that what comes back from there is bounded by what could fit."""
        self._check_stop_token_ids(limits.vocab_size)
        for i, p in enumerate(self.prompts()):
            where = "prompt" if isinstance(self.prompt, str) or _is_token_id(self.prompt[0]) else f"prompt.{i}"
            if isinstance(p, str):
                if len(p) > limits.max_text_bytes // 4 and len(p.encode("utf-8", "replace")) > limits.max_text_bytes:
                    raise BadRequest(
                        f"{where} is {len(p)} characters: more than this model's context of {limits.max_model_len} "
                        "tokens could ever hold; shorten it", where, code="context_length_exceeded")
            else:
                if len(p) > limits.max_model_len:  # (ids themselves: engine/client.validate_prompt, once)
                    raise BadRequest(
                        f"{where} has {len(p)} tokens; this model's maximum context length is "
                        f"{limits.max_model_len} tokens", where, code="context_length_exceeded")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts: text, or token ids (one list of ints is one prompt)."""
        p = self.prompt
        if p is None:
            raise BadRequest("prompt is required", "prompt")
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise BadRequest(
                "prompt must be a non-empty string, a list of token ids, or a list of such prompts", "prompt"
            )
        if all(_is_token_id(t) for t in p):
            return [p]
        if all(isinstance(x, str) for x in p) or all(
            isinstance(x, list) and all(_is_token_id(t) for t in x) for x in p
        ):
            if len(p) > MAX_BATCH_PROMPTS:
                raise BadRequest(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(p)}", "prompt")
            return list(p)
        raise BadRequest(
            "prompt must be a string, a list of token ids (non-negative integers), "
            "a list of strings, or a list of token-id lists",
            "prompt",
        )


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Messages are passed to the model's chat template as dicts, so extra keys (name, tool_call_id) survive.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def check(self, i: int) -> None:
        for part in self.content if isinstance(self.content, list) else []:
            if part.type != "text" or part.text is None:
                raise BadRequest(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                    f"got type {part.type!r}",
                    f"messages.{i}.content",
                )

    def as_template_dict(self) -> dict[str, Any]:
        return template_message(self.model_dump(exclude_none=True))  # the renderer LLM.chat uses too


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by server/tools.py (plan_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's request-level template: honoured only with --trust-request-chat-template (templates.py)
    chat_template: str | None = None
    # with --reasoning-parser: false drops the reasoning from the answer (vLLM's extension)
    include_reasoning: bool = True

    UNBUILT: ClassVar[dict[str, Any]] = UNBUILT_CHAT

    def check_limits(self, limits: Any) -> None:
        """As CompletionRequest.check_limits: a conversation that can never fit is refused before the
        template runs (every message renders to at least one token in any chat template we know)."""
        self._check_stop_token_ids(limits.vocab_size)
        if len(self.messages) > limits.max_model_len:
            raise BadRequest(f"{len(self.messages)} messages cannot fit this model's context of "
                             f"{limits.max_model_len} tokens", "messages", code="context_length_exceeded")
        size = 0
        for m in self.messages:
            parts = m.content if isinstance(m.content, list) else [m.content]
            size += sum(len(x.text or "") if isinstance(x, ContentPart) else len(x or "") for x in parts)
        if size > limits.max_text_bytes // 4 and size > limits.max_text_bytes:
            raise BadRequest(f"the messages hold {size} characters: more than this model's context of "
                             f"{limits.max_model_len} tokens could ever hold", "messages",
                             code="context_length_exceeded")

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens; None means 'fill the context'."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None, tool_schema: dict | None = None) -> SamplingParams:
        """tool_schema: the grammar tool_choice required / named imposes (server/tools.py)."""
        for i, m in enumerate(self.messages):
            m.check(i)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise BadRequest(
                "add_generation_prompt and continue_final_message cannot both be true", "messages"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if logprobs is not None and logprobs > SamplingParams.MAX_LOGPROBS:
            raise BadRequest(
                f"top_logprobs must be an integer in [0, {SamplingParams.MAX_LOGPROBS}], got {logprobs}",
                "top_logprobs",
            )
        return self._sampling_params(max_tokens, logprobs, tool_schema)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]
