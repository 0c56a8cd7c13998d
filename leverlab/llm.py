"""The Python API: LLM(model=...).generate(prompts, params), in the shape vLLM users know."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from leverlab.config import EngineConfig
from leverlab.engine.llm_engine import LLMEngine
from leverlab.outputs import RequestOutput
from leverlab.sampling_params import SamplingParams


class LLM:
    """LLM(model=PATH, dtype="bfloat16", **engine_options). Without `model`, the bundled default model."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=str(model) if model else "", **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists), all batched together; outputs in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        order = []
        for prompt, p in zip(prompts, plist):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step(final_only=True):
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in order]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it (others keep running)."""
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params or SamplingParams())
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return


__all__ = ["LLM", "SamplingParams"]
