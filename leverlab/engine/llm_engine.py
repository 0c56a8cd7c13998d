"""LLMEngine: the step loop. Each step: schedule, run the model, sample, then hand out what changed."""

from __future__ import annotations

import gc
import itertools
import logging
import time

import torch

from leverlab import env
from leverlab.config import EngineConfig, default_model_path
from leverlab.core.block_manager import BlockManager
from leverlab.core.scheduler import Scheduler
from leverlab.core.sequence import Sequence
from leverlab.engine.client import EnginePrompt, to_engine_prompt
from leverlab.engine.detokenizer import Detokenizer, find_stop
from leverlab.engine.request import Request
from leverlab.errors import RequestError
from leverlab.models.config import ModelConfig
from leverlab.models.tokenizer import load_tokenizer
from leverlab.outputs import RequestMetrics, RequestOutput
from leverlab.sampling_params import SamplingParams
from leverlab.speculative.decoder import SpecDecoder
from leverlab.speculative.eagle3_format import aux_layers_for
from leverlab.speculative_config import SpeculativeConfig
from leverlab.structured.compiler import GrammarCompiler, GrammarError
from leverlab.structured.masking import advance, prefetch
from leverlab.worker.executor import make_executor
from leverlab.worker.node import run_node
from leverlab.worker.sampler import token_ranks, top_logprobs

log = logging.getLogger("leverlab")


def serve_node(config: EngineConfig, rdv) -> int:
    """A host other than node 0 of a multi-host tensor-parallel job: its share of the ranks, no engine
    (worker/node.py), with the runner settings rank 0's engine gives its own (EAGLE's aux layers)."""
    return run_node(config, rdv, aux_layers_for(config))


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config.resolve_models()  # a Hub id becomes its cached folder (hub.py), once, here
        path = str(config.model or default_model_path())
        self.model_path = path
        self.model_config = ModelConfig.from_folder(path, config.trust_remote_code)
        if config.data_parallel_size > 1:
            raise ValueError("LLMEngine is one replica; data_parallel_size > 1 is served by engine/replicas.py "
                             "(LLM and `leverlab serve` choose it)")
        tp_size = config.tensor_parallel_size
        rdv = None
        if tp_size > 1:
            from leverlab.distributed.rendezvous import resolve

            rdv = resolve(config)
            if rdv.node_rank != 0:
                raise ValueError(f"node rank {rdv.node_rank} holds tensor-parallel workers only, no engine: start "
                                 "it with `leverlab serve ... --node-rank N` (worker/node.py)")
        # Per rank: the ranks on this host share its cores (cores // ranks each) instead of oversubscribing them.
        local_ranks = rdv.per_node if rdv is not None else 1
        threads = config.num_threads or max(1, env.default_threads(self.model_config, config.dtype) // local_ranks)
        torch.set_num_threads(threads)
        self.tokenizer = load_tokenizer(path, config.tokenizer)
        max_len = config.max_model_len or self.model_config.default_max_len
        if max_len > self.model_config.max_context:
            mc = self.model_config
            how = f", {mc.rope_scaling['rope_type']} rope scaling" if mc.rope_scaling else ""
            raise ValueError(f"--max-model-len {max_len} exceeds the model's context of {mc.max_context} tokens "
                             f"(max_position_embeddings {mc.max_position_embeddings}{how})")
        # One process, or tensor parallel (worker/executor.py: the workers, watched from here).
        self.executor = make_executor(config, path, max_len, threads, rdv, aux_layers_for(config))
        self.runner = self.executor.runner
        capacity = self.runner.num_blocks * config.block_size
        windows = self.model_config.layer_windows
        # When every layer slides, a sequence only ever holds about a window of KV, whatever its length.
        self.window = windows[0] if windows and all(w == windows[0] for w in windows) else None
        if capacity < max_len and not (self.window and capacity >= self.window + 2 * config.block_size):
            log.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity, max_len)
            max_len = capacity
        self.max_model_len = max_len
        t0 = time.monotonic()
        self.runner.warmup()
        log.info("warm-up (%s) took %.1f s", config.execution_mode, time.monotonic() - t0)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.detokenizer = Detokenizer(self.tokenizer)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.requests: dict[str, Request] = {}
        # Structured output: grammars compiled against this tokenizer, cached by their text (leverlab/structured/)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        # Monotonic totals, exported on /metrics; levers add their own keys.
        self.counters: dict[str, float] = {"requests_finished": 0, "requests_aborted": 0, "prompt_tokens": 0,
                                           "generation_tokens": 0, "preemptions": 0, "steps": 0}
        self._seq_ids = itertools.count()
        self._rng = torch.Generator().manual_seed(config.seed)
        self.spec_config = SpeculativeConfig.from_dict(config.speculative_config) if config.speculative_config else None
        # Proposing, verification, the gate and speculation's counters (speculative/decoder.py); samples plain steps too.
        self.spec = SpecDecoder(self.spec_config, config, self.runner, self.model_config.vocab_size,
                                self.eos_token_ids, self.max_model_len)
        mc = self.model_config
        params = f"{mc.num_params() / 1e6:.1f}M params" + (
            f", {mc.num_params(active=True) / 1e6:.1f}M active: {mc.num_experts_per_tok} of {mc.num_experts} experts"
            if mc.is_moe else "")
        log.info(
            "model %s (%s, %s) dtype=%s device=%s mode=%s; KV cache: %d blocks x %d tokens "
            "(%.0f MiB), max_model_len=%d, fits %d sequences of full length",
            path, mc.architecture, params, config.dtype,
            self.runner.device, config.execution_mode, self.runner.num_blocks, config.block_size,
            capacity * self.runner.kv_bytes_per_token() / 2**20, max_len, capacity // max_len,
        )
        # Everything loaded so far (torch, transformers, the model) lives as long as the engine: out of the cyclic
        # GC's sight, a full collection no longer walks ~350K objects. In a steady prefill loop of the bundled
        # model the collector had taken ~5% of the time (perf). The server freezes again after its own setup.
        gc.collect()
        gc.freeze()

    # ---- requests in -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | EnginePrompt, params: SamplingParams) -> EnginePrompt:
        """Tokenize and check a prompt (client.validate_prompt: the one check); RequestError says what to fix.
        An EnginePrompt was checked where it was made and passes through."""
        return to_engine_prompt(prompt, params.max_tokens, self.tokenizer, self.model_config.vocab_size,
                                self.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int] | EnginePrompt, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request. An EnginePrompt carries its text and the caller's tokenize time."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        t0 = time.monotonic()
        checked = self.encode(prompt, params)
        ids, text = checked.token_ids, checked.text
        self._resolve_logits_controls(params)
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else t0)
        metrics.tokenize_s = checked.tokenize_s if isinstance(prompt, EnginePrompt) else time.monotonic() - t0
        req = Request(request_id, text, ids, params, metrics)
        so = params.structured_outputs
        if so is not None:
            try:
                self.grammars.compile(so)
            except GrammarError as e:
                raise RequestError(str(e)) from e
        for i in range(params.n):
            gen = None
            if not params.greedy:
                seed = (params.seed + i) % 2**63 if params.seed is not None else int(
                    torch.randint(0, 2**62, (1,), generator=self._rng))
                gen = torch.Generator().manual_seed(seed)
            seq = Sequence(next(self._seq_ids), request_id, i, ids, params, gen)
            if so is not None:
                seq.grammar = self.grammars.new_state(so)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
                seq.prompt_ranks = [None]
            req.seqs.append(seq)
            req.detok.append(self.detokenizer.start(ids))
            req.texts.append("")
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def _resolve_logits_controls(self, params: SamplingParams) -> None:
        """The token ids a request's logits controls name, checked against the vocabulary, and its bad_words
        tokenized (vLLM does both where the request is admitted): RequestError naming the field."""
        vocab = self.model_config.vocab_size
        try:
            params.check_vocab(vocab)
            if params.bad_words and params.bad_words_token_ids is None:
                params.resolve_bad_words(lambda t: self.tokenizer.encode(t, add_special_tokens=False), vocab)
        except ValueError as e:
            raise RequestError(str(e), str(e).split(":", 1)[0]) from e

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._forget(req)
        req.metrics.finished_time = time.monotonic()
        self.counters["requests_aborted"] += 1
        return req.output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step loop -----------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step. Returns the outputs of the requests it changed (cumulative), or with `final_only`
        those of the requests it finished: a caller that only wants finished requests (LLM.generate) then
        skips building an output per request per token."""
        self.spec.propose(self.scheduler.running)
        batch = self._schedule()
        if not batch.seqs:
            return []
        masks = prefetch(batch.seqs)  # structured output: grammar masks computed while the model runs
        result = self.runner.execute(batch)
        if masks is not None:
            masks.result()
        self._record_prompt_logprobs(result.prompt_logits)
        emitted, rejected = self.spec.choose_tokens(result)  # sampling, and verification of drafts
        # Structured output: matchers take the emitted tokens; jump-forward appends the tokens they force.
        advance(emitted, self.config.structured_outputs_jump_forward, self.max_model_len)
        self.scheduler.update_from_output(batch, rejected, self.window)
        self.spec.observe(result)  # EAGLE: the features of the positions kept after verification
        outputs = self._process_outputs(emitted, final_only)
        self.spec.end_step(batch, result, emitted)
        return outputs

    def _schedule(self):
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
            self.spec.release(seq)  # the target recomputes it: draft/head KV goes back to the pool
        self.counters["preemptions"] += len(batch.preempted)
        if batch.seqs:
            self.counters["steps"] += 1
            now = time.monotonic()
            for seq in batch.seqs:
                m = self.requests[seq.request_id].metrics
                m.first_scheduled_time = m.first_scheduled_time or now
        return batch

    def _process_outputs(self, emitted, final_only: bool) -> list[RequestOutput]:
        """Append the emitted tokens (stops, detokenization), then build the outputs and retire finished work."""
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for seq, tokens, rows in emitted:
            seq.spec_token_ids = []
            req = self.requests[seq.request_id]
            n_lp = seq.params.logprobs
            lps = None
            if n_lp is not None:
                k = min(len(tokens), rows.shape[0])  # tokens past the rows were forced by a grammar: logprob 0
                chosen = torch.tensor(tokens[:k])
                lps = top_logprobs(rows[:k], chosen, [n_lp] * k) + [{t: 0.0} for t in tokens[k:]]
                ranks = token_ranks(rows[:k], chosen) + [1] * (len(tokens) - k)  # (LLM's Logprob.rank)
            for j, tok in enumerate(tokens):
                if lps is not None:
                    seq.logprobs.append(lps[j])
                    seq.ranks.append(ranks[j])
                    seq.cumulative_logprob += lps[j][tok]
                self._append(req, seq, tok, now)
                if seq.finish_reason is not None:
                    break
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if not final_only or req.finished:
                outputs.append(req.output())
            if req.finished:
                req.metrics.finished_time = time.monotonic()
                del self.requests[req.request_id]
                self._forget(req)
                self.counters["requests_finished"] += 1
                self.counters["prompt_tokens"] += len(req.prompt_token_ids)
                self.counters["generation_tokens"] += sum(len(s.output_token_ids) for s in req.seqs)
        return outputs

    def _forget(self, req: Request) -> None:
        """A request ended: drop the speculation state kept for its sequences (draft KV blocks too)."""
        for s in req.seqs:
            self.spec.release(s)

    def _append(self, req: Request, seq: Sequence, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        if seq.index == 0:
            m.token_times.append(now)
        p = seq.params
        out_len = len(seq.output_token_ids)
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        t0 = time.monotonic()
        i = seq.index
        state = req.detok[i]
        new = self.detokenizer.step(state, req.prompt_token_ids, seq.output_token_ids, p.skip_special_tokens)
        if p.stop and new and seq.finish_reason is None and out_len >= p.min_tokens:
            hit = find_stop(state.text, len(new), p.stop)
            if hit:
                at, s = hit
                state.text = state.text[: at + (len(s) if p.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", s
        m.detokenize_s += time.monotonic() - t0
        if seq.finish_reason is None and p.max_tokens is not None and out_len >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason is None and seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            req.texts[i] = state.text
        else:
            hold = max((len(s) for s in p.stop), default=1) - 1
            req.texts[i] = state.text[: len(state.text) - hold] if hold else state.text

    def _record_prompt_logprobs(self, chunks) -> None:
        for seq, first, logits in chunks:
            targets = torch.tensor(seq.prompt_token_ids[first : first + logits.shape[0]])
            rows = top_logprobs(logits, targets, [seq.params.prompt_logprobs] * len(targets))
            ranks = token_ranks(logits, targets)
            for j, (d, rank) in enumerate(zip(rows, ranks)):
                # After a preemption the prompt is recomputed: keep each position once.
                if first + j == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(d)
                    seq.prompt_ranks.append(rank)

    # ---- introspection -----------------------------------------------------------------------------
    def counter_snapshot(self) -> dict[str, float]:
        """Monotonic totals for /metrics and bench results: the engine's and each lever's."""
        return {**self.counters, **self.blocks.stats.as_counters(), **self.spec.counter_snapshot(),
                **self.executor.counters(), **self.grammars.counters()}

    @property
    def proposer(self):
        """The speculative proposer (None without speculation); tests look at its state."""
        return self.spec.proposer

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel rank died or hung (the engine cannot step any more)."""
        return self.executor.healthy

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done at exit); a one-rank engine has nothing to stop."""
        self.executor.close()

    def reset_prefix_cache(self) -> int:
        return self.blocks.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.blocks.check(self.scheduler.live)

    def kv_accounting_ok(self) -> bool:
        """check_invariants, logged rather than raised: the idle checks of AsyncLLM and of a replica count each
        failure (their integrity_errors) and go on serving."""
        try:
            self.check_invariants()
        except AssertionError as e:
            log.error("KV-cache accounting is inconsistent: %s", e)
            return False
        return True
