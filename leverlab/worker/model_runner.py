"""The model runner: owns the weights and the KV-cache tensors, turns a ScheduledBatch into logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from leverlab import env
from leverlab.config import EngineConfig
from leverlab.core.scheduler import ScheduledBatch
from leverlab.core.sequence import Sequence
from leverlab.distributed.parallel_state import TPState, local_kv_heads
from leverlab.layers import prefetch_tune
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.models import expert_reads, fused
from leverlab.models.loader import DTYPES, load_model
from leverlab.quant import kv_cache as kv_quant

log = logging.getLogger("leverlab")


def free_memory(device: torch.device) -> int:
    """Bytes free now on the device: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory from /proc/meminfo; pass --kv-cache-memory")


@dataclass
class StepLogits:
    sample_seqs: list[Sequence]  # sequences whose next token is sampled this step
    # [sum of rows, V] float32: one row per sampled sequence, 1 + k rows for one verifying k drafts
    logits: torch.Tensor
    rows_per_seq: list[int]
    # (sequence, first target position, logits [k, V]) for prompt-logprob requests
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]]
    # EAGLE only: the aux layers' outputs [T, A*H] of every computed row, and per sequence (sequence, first
    # position, first row, rows). After verification only the rows of kept positions are valid.
    aux: torch.Tensor | None = None
    aux_spans: list[tuple[Sequence, int, int, int]] | None = None
    argmax: list[int] | None = None  # per row of `logits`, when the fused step computed it


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, max_model_len: int, tp: TPState | None = None,
                 device: torch.device | None = None, aux_layers: tuple[int, ...] = ()):
        """tp: this rank's tensor-parallel state (None: one rank); the model and KV cache hold its share.
        aux_layers: the layers whose outputs the forward also returns (EAGLE's features: the engine asks the
        speculative package, speculative/eagle3_format.py: aux_layers_for); () for none."""
        self.config = config
        self.device = device or env.pick_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.tp = tp or TPState()
        self.model = load_model(model_path, config.dtype, self.device, config.quantization, tp,
                                config.lm_head_quantization, max_model_len)
        self.model_config = self.model.config
        self.aux_layers = tuple(aux_layers)  # EAGLE's feature layers; () without it
        self.model.aux_layers = self.aux_layers
        self.block_size = config.block_size
        # KV heads this rank holds: all of them, or its share under tensor parallelism (parallel_state.py)
        self.num_kv_heads = local_kv_heads(self.model_config.num_heads, self.model_config.num_kv_heads, self.tp.size)
        self.num_blocks = self._num_blocks(max_model_len)
        cfg = self.model_config
        self.step_hook = None  # rank 0 at TP > 1: sends each step's inputs to the other ranks (distributed/)
        # Per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; with --kv-cache-dtype int8/fp8
        # one byte per element plus kv_scales [2, num_blocks, block_size, num_kv_heads] (quant/kv_cache.py).
        # Indexed as that shape; each block is stored head-major (allocate says why).
        self.kv_caches, self.kv_scales = kv_quant.allocate(
            config.kv_cache_dtype, self.dtype, cfg.num_layers, self.num_blocks, self.block_size,
            self.num_kv_heads, cfg.head_dim, self.device)
        self.forward = self.model.forward
        # A mixture-of-experts model's sparse layers: their hit experts in one C++ call each (first: the fused step
        # below runs their whole MLP blocks through the same ops, and the module path keeps them for longer steps).
        fused.fused_moe(self.model)
        # Short steps (decode, verification, small chunks) on the CPU: the whole forward in one C++ call when the
        # model allows it (models/fused.py); None keeps every step on self.forward.
        self.fused = fused.fused_decoder(self.model, self.kv_caches, config.kv_cache_dtype, self.tp.size,
                                         self.kv_scales)
        self.fused_steps = 0  # steps that took it
        # Mixture of experts: the experts each decode pass's router chose, as bytes read (models/expert_reads.py).
        self.expert_reads = expert_reads.attach(self.model)
        if config.execution_mode == "compiled":
            from leverlab.worker.compiled import compile_forward

            self.forward = compile_forward(self.model, config)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the forward once per graph shape (a block-sized chunk, then one token) so that lazy
        initialization and compilation happen at start-up, not inside the first request's TTFT.
        It writes into block 0, which any later owner overwrites before reading."""
        n = min(self.block_size, 16)
        for t in (n, 1):
            def i64(x):
                return torch.tensor(x, dtype=torch.int64, device=self.device)

            meta = AttentionMetadata(i64(list(range(t))), i64([[0]]), i64([t]), i64([0, t]), t)
            with forward_context(meta, self.kv_caches, self.kv_scales):
                hidden = self.forward(i64([1] * t), i64(list(range(t))))
            if self.fused is not None:
                self.fused(i64([1] * t), i64(list(range(t))), meta)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
            self.model.compute_logits(hidden[-1:])
        measured = getattr(self.model, "prefetch_tuned", None)  # the loader's choice of weight prefetch, if it chose
        if measured and self.fused is not None and self.fused.takes_head(1) and self.tp.size == 1:
            prefetch_tune.tune_steps(self._decode_step(), measured)

    def _decode_step(self):
        """One fused decode step of one sequence at up to 128 positions of context, as a callable (for timing). Like
        the forwards above it writes only into blocks that any later owner overwrites before reading."""
        ctx = max(0, min(128, (self.num_blocks - 1) * self.block_size, self.model_config.max_position_embeddings - 1))
        table = list(range(ctx // self.block_size + 1))
        slot = table[-1] * self.block_size + ctx % self.block_size
        if not self.model_config.is_moe:
            return lambda: self.fused.step([1], [ctx], [slot], [table], [ctx + 1], [0, 1], [0])
        # A mixture of experts: a new token each step, so that its routers pick other experts, as decoding does (one
        # token over and over reads the same few experts, from the last-level cache once they fit there).
        tokens = iter(range(1 << 62))
        vocab = self.model_config.vocab_size
        return lambda: self.fused.step([next(tokens) % vocab], [ctx], [slot], [table], [ctx + 1], [0, 1], [0])

    def set_aux_capture(self, on: bool) -> None:
        """Return EAGLE's aux layers' outputs from the following steps, or not: while speculation is gated
        off, a step computes and copies nothing for the head. The compiled forward keeps one graph (aux on)."""
        layers = self.aux_layers if on else ()
        if not self.aux_layers or self.model.aux_layers == layers or self.config.execution_mode == "compiled":
            return
        self.model.aux_layers = layers
        if self.fused is not None:
            self.fused.dec.set_aux_layers(list(layers))

    def kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        return kv_quant.bytes_per_token(self.config.kv_cache_dtype, self.dtype, cfg.num_layers, self.num_kv_heads,
                                        cfg.head_dim)

    def _num_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_token() * self.block_size
        wanted = self.config.max_num_seqs * -(-max_model_len // self.block_size)
        if self.config.kv_cache_memory_fraction is not None:
            return max(1, int(self.config.kv_cache_memory_fraction * free_memory(self.device)) // per_block)
        budget = self.config.kv_cache_memory or 2 << 30  # 2 GiB unless told otherwise
        return max(1, min(wanted, budget // per_block))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens = [0], []
        sample_rows, sample_seqs, prompt_rows = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            row0 = starts[-1]
            starts.append(row0 + n)
            seq_lens.append(end)
            if end == seq.num_tokens + len(seq.spec_token_ids):
                k = len(seq.spec_token_ids)  # the last token's row, then one row after each draft
                sample_rows += range(row0 + n - 1 - k, row0 + n)
                sample_seqs.append(seq)
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                # Row r predicts position start + r + 1; keep those that are prompt positions.
                k = min(end, seq.num_prompt_tokens - 1) - start
                if k > 0:
                    prompt_rows.append((seq, start + 1, row0, k))
        rows = sample_rows + [r for (_, _, r0, k) in prompt_rows for r in range(r0, r0 + k)]
        nt = len(ids)
        fused = self.fused is not None and self.fused.takes(max(batch.num_new_tokens), nt)
        argmax = None
        if self.expert_reads is not None:
            self.expert_reads.begin(decode=len(sample_rows) == nt)  # every token sampled: decode or verification
        if fused and self.fused.takes_head(len(rows)):
            # The decoder and the head in one C++ call from plain lists: no tensors built here, logits as
            # compute_logits gives them, and their argmax for greedy sampling.
            hidden, aux, logits, argmax = self.fused.step(ids, positions, slots, [s.block_table for s in batch.seqs],
                                                          seq_lens, starts, rows)
            self.fused_steps += 1
        else:
            hidden, aux = self._forward(batch, ids, positions, slots, seq_lens, starts, rows, fused)
            # Sampling runs on the host (per-sequence CPU generators): logits are small next to the weights.
            if not prompt_rows and len(sample_rows) == nt:  # every row, in order (sample rows ascend): decode
                logits = self.model.compute_logits(hidden).cpu()
            else:
                logits = self.model.compute_logits(hidden[self._i64(rows)]).cpu() if rows else torch.empty(0, 0)
        if self.expert_reads is not None:
            if fused:  # the sparse layers routed inside the C++ step
                self.fused.record_hits(self.expert_reads)
            self.expert_reads.end()
        prompt_logits, off = [], len(sample_rows)
        for seq, first, _, k in prompt_rows:
            prompt_logits.append((seq, first, logits[off:off + k]))
            off += k
        spans = None
        if aux is not None:
            spans = [(s, s.num_computed_tokens, starts[i], n) for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))]
        return StepLogits(sample_seqs, logits[: len(sample_rows)], [1 + len(s.spec_token_ids) for s in sample_seqs],
                          prompt_logits, aux, spans, argmax[: len(sample_rows)] if argmax is not None else None)

    def counters(self) -> dict[str, float]:
        """This runner's engine counters: a mixture-of-experts model's decode passes, the experts they read and
        their weight bytes (models/expert_reads.py); none for a dense model."""
        return self.expert_reads.counters() if self.expert_reads is not None else {}

    def _i64(self, x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=self.device)

    def _forward(self, batch: ScheduledBatch, ids, positions, slots, seq_lens, starts, rows, fused: bool):
        """The decoder from tensors: the fused forward without its head, or the module path (and the other
        tensor-parallel ranks). Returns (hidden [T, H], EAGLE's aux [T, A * H] or None)."""
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        if self.step_hook is not None:  # tensor parallel: the other ranks run this same step
            self.step_hook(ids, positions, slots, tables, seq_lens, starts, rows)
        # The 1-D inputs in one tensor and views of it: one host copy instead of five (each ~5 us).
        nt, nb = len(ids), len(seq_lens)
        flat = self._i64(ids + positions + slots + seq_lens + starts)
        ids_t, pos_t, slots_t = flat[:nt], flat[nt:2 * nt], flat[2 * nt:3 * nt]
        meta = AttentionMetadata(slot_mapping=slots_t, block_tables=self._i64(tables),
                                 seq_lens=flat[3 * nt:3 * nt + nb], query_start_loc=flat[3 * nt + nb:],
                                 max_query_len=max(batch.num_new_tokens))
        if fused:
            return self.forward_step(ids_t, pos_t, meta, fused=True)
        # Fresh tensors, not views at varying offsets: a compiled graph would guard on the offset.
        return self.forward_step(self._i64(ids), self._i64(positions), meta, fused=False)

    def forward_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over one step's tensors: the one entry every rank runs (rank 0 from _forward, the other
        tensor-parallel ranks from worker/tp_worker.py with rank 0's inputs). fused: the fused forward without its
        head (one C++ call), else the module path. Returns (hidden [T, H], EAGLE's aux [T, A * H] or None)."""
        if fused:
            hidden = self.fused(ids, positions, meta)  # [T, H], one C++ call
            self.fused_steps += 1
        else:
            with forward_context(meta, self.kv_caches, self.kv_scales):
                hidden = self.forward(ids, positions)  # [T, H]
        return hidden if isinstance(hidden, tuple) else (hidden, None)  # EAGLE: (hidden, aux [T, A*H])
