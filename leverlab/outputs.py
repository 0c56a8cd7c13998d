"""What the engine hands back: per-request outputs and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field

# For each position: {token_id: logprob}, holding the chosen token and the top-N alternatives. The engine (and
# the server, which writes them as JSON) keeps plain floats; LLM hands them out as Logprob objects, as vLLM.
PositionLogprobs = dict[int, float]


@dataclass
class Logprob:
    """vLLM's shape of one entry of a position's logprobs (LLM's outputs): the token's logprob, its 1-based rank
    in the vocabulary (the tokens at least as likely, itself included) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def as_logprob_objects(position: PositionLogprobs, chosen: int | None, chosen_rank: int | None,
                       decode) -> dict[int, Logprob]:
    """One position's {token: float} as {token: Logprob}: the chosen token with its measured rank, the
    alternatives ranked by their order (1 = most likely); decode(token_id) gives each decoded_token."""
    out: dict[int, Logprob] = {}
    ranked = sorted(position.items(), key=lambda kv: -kv[1])
    for r, (tok, lp) in enumerate(ranked, start=1):
        out[tok] = Logprob(lp, r, decode(tok))
    if chosen is not None and chosen in out:
        out[chosen].rank = chosen_rank if chosen_rank is not None else out[chosen].rank
        out = {chosen: out[chosen], **{t: v for t, v in out.items() if t != chosen}}  # chosen first, as vLLM
    return out


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and the split of a request's time.

    The split sums the phases a user can act on: tokenization, waiting in the queue,
    prefill (first scheduled -> first token), decode (first token -> last token) and detokenization.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one timestamp per generated token
    tokenize_s: float = 0.0
    detokenize_s: float = 0.0
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0

    @property
    def queue_s(self) -> float:
        return (self.first_scheduled_time or self.arrival_time) - self.arrival_time

    @property
    def prefill_s(self) -> float:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return 0.0
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_s(self) -> float:
        if self.first_token_time is None or self.last_token_time is None:
            return 0.0
        return self.last_token_time - self.first_token_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def timings(self) -> dict[str, float]:
        """The per-request split, in milliseconds, as returned by the server's `timings` field."""
        return {
            "tokenize_ms": 1e3 * self.tokenize_s,
            "queue_ms": 1e3 * self.queue_s,
            "prefill_ms": 1e3 * self.prefill_s,
            "decode_ms": 1e3 * self.decode_s,
            "detokenize_ms": 1e3 * self.detokenize_s,
        }


@dataclass
class CompletionOutput:
    """One generated sequence. `text` and `token_ids` are cumulative and only ever grow while streaming."""

    index: int
    text: str
    token_ids: list[int]
    # With SamplingParams.logprobs: per output token, {token: logprob} from the engine (the server reads these),
    # {token: Logprob} from LLM (vLLM's shape); None without.
    logprobs: list[PositionLogprobs] | list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None  # the output tokens' summed logprob; None without logprobs (as vLLM)
    ranks: list[int] | None = None  # with logprobs: each output token's rank in the vocabulary

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | list[dict[int, Logprob] | None] | None = None  # None at 0
    # with prompt_logprobs: each prompt token's 1-based rank in the whole vocabulary (None at position 0)
    prompt_ranks: list[int | None] | None = None
