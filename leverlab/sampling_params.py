"""Per-request sampling parameters, in the shape vLLM users know."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM 0.32's StructuredOutputsParams): exactly one of `json` (a JSON
    schema, dict or text), `json_object` (any JSON object), `regex`, `choice` (one of these strings) or
    `grammar` (Lark or GBNF/EBNF text). Compiled by leverlab/structured/ (llguidance)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options we do not implement: refused when set, never ignored
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {set_ or 'none'}")
        # (disable_any_whitespace is accepted: our JSON is always compact, see structured/compiler.py)
        for name in ("disable_additional_properties", "whitespace_pattern", "structural_tag"):
            if getattr(self, name):
                raise ValueError(f"structured_outputs.{name} is not supported; omit it")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object, or its text)")

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on; the grammar cache's key."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)  # (key order is the properties' order)
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", str(self.grammar)

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not a known field")
        return cls(**d)


@dataclass
class SamplingParams:
    """What to generate for one request.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1.0 disable those filters.
    `logprobs=N` returns, for every generated token, the chosen token's logprob plus the top-N;
    `prompt_logprobs=N` does the same for every prompt token after the first.
    The logits controls are vLLM's, with its names, ranges and order (worker/logits_processors.py):
    allowed_token_ids (only these may be picked), bad_words (never produce these words; the engine tokenizes
    them), logit_bias ({token id: bias}, clamped to [-100, 100]), repetition_penalty (prompt and output tokens),
    frequency_penalty / presence_penalty (output tokens), then min_p after temperature.
    Invalid values raise ValueError with a message that says what to fix.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token-id sequences: filled by the engine, which has the tokenizer (resolve_bad_words)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a grammar

    MAX_LOGPROBS = 20
    MAX_BAD_WORDS = 128  # token sequences after tokenizing (vLLM's VLLM_MAX_NUM_BAD_WORDS default)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < 1e-5:
            self.temperature = 0.0  # as vLLM: a vanishing temperature is greedy (and would overflow softmax)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.n > 64:
            raise ValueError(f"n must be at most 64, got {self.n}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= self.MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {self.MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self._check_logits_controls()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    def _check_logits_controls(self) -> None:
        """vLLM's ranges for the logits controls; logit_bias keys become ints and values are clamped."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number greater than 0, got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            bias = {}
            for k, v in dict(self.logit_bias).items():
                try:
                    tid = int(k)  # OpenAI sends the ids as JSON object keys: strings
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                if tid < 0 or isinstance(k, bool):
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {k!r}")
                if not _is_number(v) or v != v or v in (float("inf"), float("-inf")):
                    raise ValueError(f"logit_bias values must be finite numbers, got {v!r}")
                bias[tid] = min(100.0, max(-100.0, float(v)))  # OpenAI's and vLLM's clamp
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (omit it to allow every token)")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative integers")
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            # each word is at least one token sequence: refuse too many before anyone tokenizes them
            if len(self.bad_words) > self.MAX_BAD_WORDS:
                raise ValueError(f"bad_words: at most {self.MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            self.bad_words = list(self.bad_words) or None

    @property
    def needs_logits_processing(self) -> bool:
        """Whether any control other than temperature / top-k / top-p / min_p changes this request's logits:
        rows of requests without one skip logits_processors entirely."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def resolve_bad_words(self, encode, vocab_size: int) -> None:
        """Tokenize bad_words as vLLM does: each word alone and after a space (the word inside a text), the
        spaced form kept when it is a different first token of the same length. encode(text) -> ids."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for prefix in ("", " "):
                ids = list(encode(prefix + word.lstrip()))
                if not ids:
                    if not prefix:
                        raise ValueError(f"bad_words: {word!r} tokenizes to no token")
                    continue
                if not prefix or (ids[0] != seqs[-1][0] and len(ids) == len(seqs[-1])):
                    seqs.append(ids)
        if len(seqs) > self.MAX_BAD_WORDS:
            raise ValueError(f"bad_words: {len(seqs)} token sequences after tokenizing; at most {self.MAX_BAD_WORDS}")
        bad = [t for ids in seqs for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"bad_words: token ids {bad} are outside the vocabulary [0, {vocab_size})")
        self.bad_words_token_ids = seqs

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must be in the model's vocabulary (ValueError naming the field)."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())), ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is out of the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
