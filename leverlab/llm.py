"""The Python API: LLM(model=...).generate(prompts, params), in the shape vLLM users know.

Prompts take vLLM's forms: a string, a list of token ids, `{"prompt": str}` (TextPrompt) or
`{"prompt_token_ids": [...]}` (TokensPrompt), or a list of any of these. An LLM holds processes when it runs
tensor-parallel or data-parallel (`data_parallel_size=N`: N engine processes, each prompt routed to
one): `close()` (or `with LLM(...) as llm:`) stops them, and so does collecting the object.
"""

from __future__ import annotations

import itertools
import queue
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from leverlab.config import EngineConfig
from leverlab.engine.llm_engine import LLMEngine
from leverlab.errors import RequestError
from leverlab.outputs import RequestOutput
from leverlab.sampling_params import SamplingParams

PromptType = str | list[int] | Mapping[str, Any]


def _one_prompt(p: Any) -> str | list[int]:
    """A prompt in any of vLLM's single forms, as text or token ids."""
    if isinstance(p, str):
        return p
    if isinstance(p, Mapping):
        keys = set(p) & {"prompt", "prompt_token_ids"}
        if len(keys) != 1:
            raise RequestError("a dict prompt needs exactly one of 'prompt' (text) or 'prompt_token_ids', "
                               f"got keys {sorted(p)}")
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise RequestError(f"'prompt' must be a string, got {type(p['prompt']).__name__}")
            return p["prompt"]
        return list(p["prompt_token_ids"])
    if isinstance(p, (list, tuple)):
        return list(p)
    raise RequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(p).__name__}")


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        return [_one_prompt(prompts)]
    return [_one_prompt(p) for p in prompts]


class LLM:
    """LLM(model=PATH, dtype="bfloat16", **engine_options). Without `model`, the bundled default model."""

    def __init__(self, model: str | None = None, **kwargs):
        config = EngineConfig(model=str(model) if model else "", **kwargs)
        if config.data_parallel_size > 1:  # replica processes, prompts spread over them (engine/replicas.py)
            from leverlab.engine.replicas import ReplicaSet

            self.engine = ReplicaSet(config)
        else:
            self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # Stops the tensor-parallel workers when the LLM is collected (or at exit) even without close();
        # it holds the engine, never the LLM, so it does not keep the LLM alive.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallel); the LLM cannot generate afterwards.
        Idempotent. A later LLM in the same process (tensor parallel too) then starts cleanly."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (any of vLLM's forms), all batched together; outputs in input order."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was closed")
        plist_prompts = _prompt_list(prompts)
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(plist_prompts)
        if len(plist) != len(plist_prompts):
            raise ValueError(f"{len(plist_prompts)} prompts but {len(plist)} SamplingParams")
        if not isinstance(self.engine, LLMEngine):
            return self._generate_on_replicas(plist_prompts, plist)
        order = []
        for prompt, p in zip(plist_prompts, plist):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step(final_only=True):
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in order]

    def _submit(self, prompt: str | list[int], params: SamplingParams, sink) -> str:
        rid = f"llm-{next(self._ids)}"
        self.engine.submit(rid, self.engine.encode(prompt, params), params, sink, time.monotonic(), bounded=False)
        return rid

    def _generate_on_replicas(self, prompts: list, plist: list[SamplingParams]) -> list[RequestOutput]:
        """Every prompt routed to a replica at once; the replicas' outputs arrive on one queue."""
        inbox: queue.Queue = queue.Queue()
        order = [self._submit(prompt, p, inbox.put) for prompt, p in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(order):
            item = inbox.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                done[item.request_id] = item
        return [done[r] for r in order]

    def stream(self, prompt: PromptType, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it (others keep running)."""
        if not isinstance(self.engine, LLMEngine):
            inbox: queue.Queue = queue.Queue()
            self._submit(_one_prompt(prompt), params or SamplingParams(), inbox.put)
            while True:
                item = inbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, _one_prompt(prompt), params or SamplingParams())
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return


__all__ = ["LLM", "SamplingParams"]
