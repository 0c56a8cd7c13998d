"""The Python API: LLM(model=...).generate(prompts, sampling_params), in the shape vLLM users know, so a
script written for vLLM's offline API runs with only its import line changed.

`model` is a folder or a Hugging Face Hub id (resolved through the Hub's cache, config.py: resolve_models).
vLLM's constructor keywords map onto EngineConfig (engine_args.llm_kwargs); one with no counterpart here is refused by
name, never dropped. Prompts take vLLM's forms: a string, a list of token ids, `{"prompt": str}` (TextPrompt)
or `{"prompt_token_ids": [...]}` (TokensPrompt), or a list of any of these; `chat()` renders conversations with
the chat template as the server does (leverlab/chat.py). Logprobs come back as vLLM's `Logprob` objects, with
`cumulative_logprob`. An LLM holds processes when it runs tensor-parallel or data-parallel
(`data_parallel_size=N`: N engine processes, each prompt routed to one): `close()` (or `with LLM(...) as llm:`)
stops them, and so does collecting the object.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from leverlab.chat import render_chat, template_message
from leverlab.config import EngineConfig
from leverlab.engine.llm_engine import LLMEngine
from leverlab.engine_args import llm_kwargs
from leverlab.errors import RequestError, UnsupportedLever
from leverlab.outputs import RequestOutput, as_logprob_objects
from leverlab.sampling_params import SamplingParams

PromptType = str | list[int] | Mapping[str, Any]


def _one_prompt(p: Any) -> str | list[int]:
    """A prompt in any of vLLM's single forms, as text or token ids."""
    if isinstance(p, str):
        return p
    if isinstance(p, Mapping):
        extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
        if extra:  # vLLM's multi_modal_data, cache_salt, ...: refused by name, never dropped
            raise RequestError(f"prompt keys {extra} are not supported by LeverLab; a prompt dict takes 'prompt' "
                               "or 'prompt_token_ids'")
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


# LLM.generate / LLM.chat keywords of vLLM that we do not build: refused when set (None is their default)
UNBUILT_CALL_KWARGS = ("lora_request", "priority", "tokenization_kwargs", "mm_processor_kwargs")


def _refuse_unbuilt(method: str, kwargs: dict[str, Any], extra: dict[str, Any]) -> None:
    if extra:
        raise UnsupportedLever(f"LLM.{method}(): unknown keyword {', '.join(sorted(extra))}")
    unbuilt = [k for k in UNBUILT_CALL_KWARGS if kwargs.get(k) is not None]
    if unbuilt:
        raise UnsupportedLever(f"LLM.{method}(): {', '.join(unbuilt)} {'is' if len(unbuilt) == 1 else 'are'} not "
                               "supported by LeverLab; leave it out")


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        return [_one_prompt(prompts)]
    return [_one_prompt(p) for p in prompts]


class LLM:
    """LLM(model=PATH_OR_HUB_ID, dtype="bfloat16", **engine_options). Without `model`, the bundled default model.
    Options: EngineConfig's fields, and vLLM's names for them (gpu_memory_utilization, enforce_eager, ...)."""

    def __init__(self, model: str | None = None, **kwargs):
        engine_kwargs, own = llm_kwargs(kwargs)
        config = EngineConfig(model=str(model) if model else "", **engine_kwargs)
        self.chat_template: str | None = own["chat_template"]
        if config.data_parallel_size > 1:  # replica processes, prompts spread over them (engine/replicas.py)
            from leverlab.engine.replicas import ReplicaSet

            self.engine = ReplicaSet(config)
        else:
            self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._token_text: dict[int, str] = {}  # decoded_token of Logprob, per token id
        # Stops the tensor-parallel workers when the LLM is collected (or at exit) even without close();
        # it holds the engine, never the LLM, so it does not keep the LLM alive.
        self._finalizer = weakref.finalize(self, self.engine.close)

    def get_tokenizer(self):
        """vLLM's accessor: the model's tokenizer."""
        return self.tokenizer

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
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        priority: Any = None,
        tokenization_kwargs: Any = None,
        mm_processor_kwargs: Any = None,
        **extra: Any,
    ) -> list[RequestOutput]:
        """Generate for every prompt (any of vLLM's forms), all batched together; outputs in input order.
        `sampling_params` (vLLM's name; `params` is ours, either works): one for all prompts, or one each.
        `use_tqdm` is accepted (no progress bar is drawn); vLLM's LoRA, priority and multimodal arguments
        are refused when set."""
        _refuse_unbuilt("generate", dict(lora_request=lora_request, priority=priority,
                                         tokenization_kwargs=tokenization_kwargs,
                                         mm_processor_kwargs=mm_processor_kwargs), extra)
        if params is not None and sampling_params is not None:
            raise ValueError("LLM.generate(): give sampling_params or params (the same thing), not both")
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was closed")
        plist_prompts = _prompt_list(prompts)
        params = sampling_params if sampling_params is not None else params
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(plist_prompts)
        if len(plist) != len(plist_prompts):
            raise ValueError(f"{len(plist_prompts)} prompts but {len(plist)} SamplingParams")
        if not isinstance(self.engine, LLMEngine):
            return [self._vllm_shape(o) for o in self._generate_on_replicas(plist_prompts, plist)]
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
        return [self._vllm_shape(done[r]) for r in order]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        priority: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: Any = None,
        mm_processor_kwargs: Any = None,
        **extra: Any,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, each
        rendered by the chat template (`chat_template`, else the one given to LLM(...), else the tokenizer's)
        exactly as the server renders /v1/chat/completions, then generated like generate()."""
        _refuse_unbuilt("chat", dict(lora_request=lora_request, priority=priority,
                                     tokenization_kwargs=tokenization_kwargs,
                                     mm_processor_kwargs=mm_processor_kwargs), extra)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise UnsupportedLever(f"LLM.chat(): chat_template_content_format {chat_template_content_format!r} is "
                                   "not one of 'auto', 'string', 'openai'")
        if isinstance(messages, Mapping) or not messages:
            raise RequestError("LLM.chat(): messages must be a conversation (a non-empty list of message dicts) "
                               "or a list of conversations")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        template = chat_template if chat_template is not None else self.chat_template
        name = self.engine.config.model_id or self.engine.config.model or "this model"
        prompts = []
        for conv in conversations:
            if not conv or isinstance(conv, (str, Mapping)):
                raise RequestError("LLM.chat(): each conversation must be a non-empty list of message dicts")
            prompts.append(render_chat(self.tokenizer, [template_message(m, i) for i, m in enumerate(conv)],
                                       chat_template=template, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs, model_name=name))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _decoded(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _vllm_shape(self, out: RequestOutput) -> RequestOutput:
        """The engine's output as vLLM hands it out: logprobs (and prompt_logprobs) as {token: Logprob}, with
        ranks and decoded tokens. The engine keeps floats (the server writes those), so this is a copy."""
        outputs = out.outputs
        if any(o.logprobs is not None for o in outputs):
            outputs = [o if o.logprobs is None else dataclasses.replace(o, logprobs=[
                as_logprob_objects(pos, tok, rank, self._decoded)
                for pos, tok, rank in zip(o.logprobs, o.token_ids, o.ranks or [None] * len(o.token_ids))])
                for o in outputs]
        prompt_lps = out.prompt_logprobs
        if prompt_lps is not None:
            ranks = out.prompt_ranks or [None] * len(prompt_lps)
            prompt_lps = [None if pos is None else as_logprob_objects(pos, tok, rank, self._decoded)
                          for pos, tok, rank in zip(prompt_lps, out.prompt_token_ids, ranks)]
        if outputs is out.outputs and prompt_lps is out.prompt_logprobs:
            return out
        return dataclasses.replace(out, outputs=outputs, prompt_logprobs=prompt_lps)

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
                yield self._vllm_shape(item)
                if item.finished:
                    return
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, _one_prompt(prompt), params or SamplingParams())
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield self._vllm_shape(out)
                    if out.finished:
                        return


__all__ = ["LLM", "SamplingParams"]
