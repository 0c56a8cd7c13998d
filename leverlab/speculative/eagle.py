"""EAGLE proposer: a one-layer head drafts from the target's own hidden states (speculative/eagle_head.py).

Per target sequence the head keeps a shadow (its own paged KV in its own block pool, parallel degree 1) and
the fused features of target positions it has not consumed yet. Head rows hold the positions whose features
the target computed, in order, each rotated at its own position; positions without features leave a gap
rather than a restart: a prefix-cache hit skips the target's compute for cached prompt positions, and while
the speculation gate is shut no features are captured at all. The head attends over the rows it has (its
acceptance may dip after a gap; correctness never depends on the head).

Flow each step:
  observe(result)  after verification: keep the aux rows of positions the target kept (accepted tokens
                   only), fused by the head's fc into [n, H] features, as pending rows
  propose(...)     one batched head pass consumes every pending row (lazy prefill of the head's KV, merged
                   with the first draft), then one pass per further draft, feeding the head's own output
                   hidden state as the feature; draft rows are never counted as computed, so the next
                   catch-up overwrites them with rows built from the target's real features.
A pass (`_run`) is one C++ call where it can be (speculative/eagle_fused.py: the CPU, at most 16 rows per sequence)
and the head's modules otherwise; both return the hidden states and the drafting logits of the rows that draft.
What drafting reads may be int8 (`quantization` in the speculative config; `_drafting_weights`).
Invariant: next_position is the target position after the last feature received (pending or in the KV);
the pending chunks are in position order, each a run of consecutive positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leverlab import env
from leverlab.config import default_model_path
from leverlab.core.block_manager import BlockManager
from leverlab.core.sequence import Sequence
from leverlab.errors import UnsupportedLever
from leverlab.kernels import cpu_kernels
from leverlab.layers import bf16_linear
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.layers.linear import Linear
from leverlab.models.config import ModelConfig
from leverlab.models.loader import (
    DTYPES,
    attach_quant_method,
    finish_quantization,
    load_embedding_and_lm_head,
)
from leverlab.quant import kv_cache as kv_quant
from leverlab.quant.registry import get_quant_method
from leverlab.speculative.base import Draft
from leverlab.speculative.eagle3_format import load_head
from leverlab.speculative.eagle_fused import FusedHead, fused_head
from leverlab.worker.sampler import probabilities


@dataclass(eq=False)
class _State:
    shadow: Sequence  # head KV accounting: block table; num_computed_tokens = head rows with valid KV
    next_position: int  # the target position after the last feature received
    pending: list[torch.Tensor] = field(default_factory=list)  # fused features [n, H], in position order
    pending_at: list[int] = field(default_factory=list)  # first target position of each pending chunk
    n_pending: int = 0


class EagleProposer:
    needs_features = True

    def __init__(self, head, path: str, engine_config, quantization: str = "auto"):
        self.head, self.path, self.engine_config = head, path, engine_config
        self.quantization = quantization  # the speculative config's: auto | none | int8 (drafting weights)
        self.draft_head: torch.nn.Module | None = None  # what drafts go through (attach): a Linear [V or Vd, H]
        self.fused: FusedHead | None = None  # the head's pass in one C++ call (attach), where it runs
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        self.target = None  # the target CausalLM (embedding and lm_head are shared): set by attach()
        self.own_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # (embedding, lm_head) at TP > 1
        self.blocks: BlockManager | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[int, _State] = {}  # by target sequence id

    @classmethod
    def from_config(cls, spec, engine_config, max_model_len: int) -> EagleProposer:
        layers = ModelConfig.from_folder(engine_config.model or default_model_path()).num_layers
        head = load_head(spec.model, DTYPES[engine_config.dtype], env.pick_device(engine_config.device), layers,
                         max_model_len)
        return cls(head, spec.model, engine_config, spec.quantization)

    def check_vocab(self, target_vocab: int) -> None:
        pass  # checked with the rest of the target's shape in attach()

    def attach(self, runner) -> None:
        """Share the target's embedding and lm_head; size the head's KV pool like the target's."""
        cfg = self.head.config
        cfg.check_target(runner.model_config, self.path)
        if tuple(runner.model.aux_layers) != tuple(cfg.aux_layer_ids):
            raise UnsupportedLever(f"target returns aux layers {runner.model.aux_layers}, head {self.path} "
                                   f"expects {cfg.aux_layer_ids}")
        self.target = runner.model
        if getattr(getattr(runner, "tp", None), "size", 1) > 1:
            # The target's embedding and lm_head are sharded, and using them takes every rank's part in a
            # collective: the head (rank 0 only) reads its own full copy from the checkpoint instead.
            path = self.engine_config.model or default_model_path()
            self.own_weights = load_embedding_and_lm_head(path, self.dtype, self.device)
        bs = runner.block_size
        # As many tokens as the target's pool, plus headroom for the K - 1 draft rows of each sequence.
        num_blocks = runner.num_blocks + self.engine_config.max_num_seqs
        self.blocks = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        # The head's own bf16 cache, in the target's layout (kv_cache.allocate: head-major blocks).
        self.kv_caches, _ = kv_quant.allocate("auto", self.dtype, 1, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim,
                                              self.device)
        self.draft_head = self._drafting_weights()
        if self.device.type == "cpu":
            self.fused = fused_head(self.head, self._embedding_table(), self.draft_head, self.kv_caches[0])

    def _drafting_weights(self) -> torch.nn.Module:
        """Quantize what drafting reads (the head's linears and the head it drafts through) where the
        speculative config asks for it or `auto` picks it: int8 where our int8 kernels serve (the CPU, bf16/fp16).
        Drafts only propose, verification decides, so this changes speed and acceptance, never the output: on the
        bundled model the int8 drafts were accepted as often as the bf16 ones and a step took 1.09x less.
        Returns the Linear the drafts go through."""
        head = self.head
        if head.lm_head is not None:
            drafting, private = head.lm_head, True  # its own, over its draft vocabulary
        elif self.own_weights is not None:
            drafting, private = _linear_over(self.own_weights[1]), True
        else:
            drafting, private = self.target.lm_head, False  # shared with the target
        method = self.quantization
        if method == "auto":
            method = "int8" if (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
                                and cpu_kernels.kernels() is not None) else "none"
        if method != "int8":
            return drafting
        int8 = get_quant_method("int8")
        with torch.no_grad():
            layers = attach_quant_method(head, int8, int8)  # every Linear of the head, its own lm_head included
            if drafting is not head.lm_head and drafting.quant_method is None:
                if not private:
                    # The target's head stays as it is for the target; drafts read an int8 copy (V x H bytes
                    # more memory: 8 MB on the bundled model, 156 MB on a Qwen3-0.6B). A quantized target head
                    # (int8/int4 targets) is used as it is.
                    drafting = _linear_over(drafting.method.dequantize(drafting).to(drafting.weight.dtype)
                                            if drafting.kernel_state.tiles else drafting.weight.detach().clone())
                drafting.use(int8)
                int8.create_weights(drafting)
                layers.append(drafting)
            finish_quantization(layers)
        return drafting

    def _embedding_table(self) -> torch.Tensor:
        """The table drafted tokens are looked up in: the head's own (EAGLE-3 checkpoints may bring one), the
        target's full copy at tensor-parallel size > 1, else the target's."""
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens.weight.data
        if self.own_weights is not None:
            return self.own_weights[0]
        return self.target.model.embed_tokens.weight.data

    def release(self, seq: Sequence) -> None:
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.release(st.shadow)

    # ---- features in -------------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, result) -> None:
        """After verification: take the aux rows of the positions each sequence kept."""
        picks: list[torch.Tensor] = []
        owners: list[tuple[_State, int, int]] = []
        for seq, first, row0, n in result.aux_spans:
            keep = min(n, seq.num_computed_tokens - first)  # rejected drafts' rows are dropped
            st = self.states.get(seq.seq_id)
            if st is None:
                shadow = Sequence(seq.seq_id, seq.request_id, seq.index, [], seq.params, _generator(seq))
                st = self.states[seq.seq_id] = _State(shadow, first)
            # Rows the head already has are skipped; after a gap (first > next_position) none are.
            skip = max(0, st.next_position - first)
            if keep > skip:
                picks.append(torch.arange(row0 + skip, row0 + keep))
                owners.append((st, first + skip, keep - skip))
                st.next_position = first + keep
        if not picks:
            return
        fused = self.head.fuse(result.aux[torch.cat(picks).to(result.aux.device)].to(self.dtype))  # [N, H]
        for (st, p0, n), chunk in zip(owners, fused.split([n for _, _, n in owners])):
            st.pending.append(chunk)
            st.pending_at.append(p0)
            st.n_pending += n

    # ---- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        active: list[tuple[int, Sequence, _State, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self.states.get(seq.seq_id)
            # Features must reach the last computed position (seq.num_tokens - 2): its row drafts token 1.
            if k <= 0 or st is None or not st.n_pending or st.next_position != seq.num_tokens - 1:
                continue
            rows = st.shadow.num_computed_tokens + st.n_pending + k - 1  # the k - 1 fed-back drafts too
            if not self.blocks.can_grow(st.shadow, rows):
                continue  # the head's pool is full: no drafts for this sequence this step
            self.blocks.grow(st.shadow, rows)
            active.append((i, seq, st, k))
        if not active:
            return drafts
        # Pass 0: every pending row (the head's lazy prefill), whose last row drafts the first token.
        ids, positions, feats, spans = [], [], [], []
        for _, seq, st, _ in active:
            done, n = st.shadow.num_computed_tokens, st.n_pending
            for p0, chunk in zip(st.pending_at, st.pending):
                m = chunk.shape[0]
                ids += _tokens(seq, p0 + 1, p0 + m + 1)  # the row at position p reads the token at p + 1
                positions += range(p0, p0 + m)
            feats += st.pending
            spans.append((st.shadow, done, n))
            st.shadow.num_computed_tokens += n
            st.pending, st.pending_at, st.n_pending = [], [], 0
        last = [sum(n for _, _, n in spans[: j + 1]) - 1 for j in range(len(spans))]
        hidden, logits, greedy = self._run(spans, ids, positions, torch.cat(feats), last)
        h = hidden[torch.tensor(last, device=hidden.device)]  # [B, H]
        probs: dict[int, list[torch.Tensor]] = {}
        step = 0
        while True:
            toks = self._pick(logits, greedy, active, drafts, probs)
            step += 1
            keep = [j for j, (_, _, _, k) in enumerate(active) if k > step]
            if not keep:
                break
            active = [active[j] for j in keep]
            h = h[torch.tensor(keep, device=h.device)]
            # Draft row: the token just drafted, with the head's own output standing in for the feature.
            spans, positions = [], []
            for _, _, st, _ in active:
                row = st.shadow.num_computed_tokens + step - 1  # uncounted: the next catch-up overwrites it
                spans.append((st.shadow, row, 1))
                positions.append(st.next_position + step - 1)  # the draft's own position
            h, logits, greedy = self._run(spans, [toks[j] for j in keep], positions, self.head.feedback(h),
                                          list(range(len(keep))))
        for i, qs in probs.items():
            drafts[i].probs = torch.stack(qs)
        return drafts

    def _pick(self, logits, greedy, active, drafts, probs) -> list[int]:
        """Draft one token per active sequence from its row of the drafting logits [B, V] (float32, target ids)
        and their argmax."""
        toks = []
        for row, (i, seq, st, _) in enumerate(active):
            if seq.params.greedy:
                tok = greedy[row]
            else:
                q = probabilities(logits[row], seq.params)
                tok = int(torch.multinomial(q, 1, generator=st.shadow.generator))
                probs.setdefault(i, []).append(q)
            drafts[i].tokens.append(tok)
            toks.append(tok)
        return toks

    def _run(self, spans, ids: list[int], positions: list[int], features: torch.Tensor, rows: list[int]):
        """One head pass. spans: (shadow, first row, rows) per sequence, rows flattened in that order. Returns the
        head's hidden states [T, H] (before its output norm), the drafting logits of `rows` (float32 [R, V] over
        the target's vocabulary, on the CPU) and their argmax (a list)."""
        bs = self.blocks.block_size
        slots, starts, lens = [], [0], []
        for shadow, first, n in spans:
            table = shadow.block_table
            slots += [table[r // bs] * bs + r % bs for r in range(first, first + n)]
            starts.append(starts[-1] + n)
            lens.append(first + n)
        tables = [s.block_table for s, _, _ in spans]
        if self.fused is not None and self.fused.takes(spans):
            hidden, logits, greedy = self.fused.run(ids, features, positions, slots, tables, lens, starts, rows)
            if self.head.lm_head is not None:  # argmax over the draft vocabulary: back to target ids
                greedy = self.head.draft_to_target[torch.tensor(greedy)].tolist()
                logits = self._to_target(logits)
            return hidden, logits, greedy
        width = max(len(t) for t in tables)

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        meta = AttentionMetadata(slot_mapping=t(slots), block_tables=t([tb + [0] * (width - len(tb)) for tb in tables]),
                                 seq_lens=t(lens), query_start_loc=t(starts), max_query_len=max(n for _, _, n in spans))
        embeds = self._embed(t(ids))
        with forward_context(meta, self.kv_caches):
            hidden = self.head(t(positions), embeds, features)
        logits = self._logits(self.head.norm(hidden[t(rows)])).cpu()
        return hidden, logits, logits.argmax(dim=-1).tolist()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return bf16_linear.embedding(ids, self._embedding_table())  # the target's may be its head's tiles

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] (normed) -> float32 logits [B, V] over the TARGET's vocabulary."""
        small = self.draft_head(hidden).float()  # draft_head: set by attach()
        return self._to_target(small) if self.head.lm_head is not None else small

    def _to_target(self, small: torch.Tensor) -> torch.Tensor:
        """Logits over the head's draft vocabulary [B, Vd] put back at the target ids; ids the draft cannot say
        get -inf (probability 0), so greedy picks and sampled q live on target ids."""
        full = small.new_full((small.shape[0], self.head.config.vocab_size), float("-inf"))
        full[:, self.head.draft_to_target.to(small.device)] = small
        return full


def _linear_over(weight: torch.Tensor) -> Linear:
    """A bias-free Linear around an existing [out, in] weight (no other allocation)."""
    with torch.device("meta"):
        lin = Linear(weight.shape[1], weight.shape[0])
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    return lin


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """seq's tokens [start, end) (prompt then output) without copying the whole sequence."""
    prompt, n = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return seq.output_token_ids[start - n : end - n]
    return prompt[start:] + seq.output_token_ids[: end - n]


def _generator(seq: Sequence) -> torch.Generator | None:
    """The head's own RNG for sampled drafts: seeded from the request's seed, so a seed reproduces."""
    if seq.params.greedy:
        return None
    seed = seq.params.seed
    seed = (seed ^ 0xEA61E) + seq.index if seed is not None else int(torch.randint(0, 2**62, (1,)))
    return torch.Generator().manual_seed(seed)
