"""A request: n sequences sharing one prompt, their text so far, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field

from leverlab.core.sequence import Sequence
from leverlab.engine.detokenizer import DetokState
from leverlab.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leverlab.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    detok: list[DetokState] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # released text per sequence (only ever grows)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=self.texts[i],
                token_ids=list(s.output_token_ids),
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                ranks=list(s.ranks) if s.params.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(self.seqs)
        ]
        first = self.seqs[0]
        self.metrics.num_cached_prompt_tokens = first.num_cached_tokens or 0
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            prompt_ranks=list(first.prompt_ranks) if first.prompt_ranks is not None else None,
        )
