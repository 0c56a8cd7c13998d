"""The bandwidth model: what each configuration should do if decode were bound by memory reads.

One decode pass reads every weight once plus the KV cache of each sequence in the batch:
    bytes_per_pass = linear_params * bits/8 + head_params * head_bits/8 + other_params' * dtype_bytes
                     + B * context * kv_bytes
(the output head in int8 under int8 and int6 under int4, as the engine's --lm-head-quantization auto puts it;
other_params' the embedding and norms left beside it)
and produces B * tokens_per_pass tokens, where tokens_per_pass = G / (G - A) from the server's counters
(G tokens generated, A draft tokens accepted: every pass yields exactly one token of its own plus the accepted
drafts). So:
    roofline decode tok/s (one stream) = tokens_per_pass * bandwidth / bytes_per_pass
    calibrated: a pass costs t_fixed + bytes/bandwidth, with t_fixed fitted once on the baseline's measurement
    (scheduling, dispatch, sampling, streaming: what a small model on a CPU mostly pays), applied to the rest,
    plus, under tensor parallelism, the all-reduce time per pass the engine measured (tp_allreduce_seconds /
    tp_steps from its counters) when the configuration ran: bytes alone would promise TP a free split.
The predicted speedup of a configuration over its parent is the ratio of those rates; the report puts it
beside the measured ratio and explains large gaps.

A mixture-of-experts pass reads only the experts its tokens chose. Where the server counted them (LeverLab's
leverlab_engine_moe_weight_bytes_read_total / leverlab_engine_moe_decode_passes_total over the configuration's
run: models/expert_reads.py), those measured weight bytes per pass replace the weight terms above, at the
configuration's own precision and (under tensor parallelism) rank 0's share as measured; the KV term stays. Where
it did not (another engine, an older server), the estimate stands: attention + shared experts + num_experts_per_tok
experts per sparse layer (ModelConfig active_params), right at one sequence, low for a batch, whose tokens pick more
distinct experts; the report labels which one each row used (weight_bytes_source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leverlab.study.plan import Levers

DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
# Storage bits per quantized weight, scales included (as leverlab/quant stores them).
QUANT_BITS = {
    "int8": 8 + 16 / 384,  # one 16-bit scale per output row; ~8 for any realistic row length
    "fp8": 8.0,
    "int4": 4 + 32 / 64,  # 16-bit scale + 16-bit zero per group of 64
    "int4-g32": 4 + 32 / 32,
    "int4-g64": 4 + 32 / 64,
    "int4-g128": 4 + 32 / 128,
    "int6": 6 + 32 / 64,
    "awq": 4 + 32 / 128,
    "gptq": 4 + 32 / 128,
}
GAP_THRESHOLD = 0.25  # |measured / predicted - 1| above this gets an explanation


@dataclass(frozen=True)
class ModelFacts:
    linear_params: int  # the decoder layers' matmul weights (what quantization shrinks)
    other_params: int  # embeddings / tied head / norms (the head among them: head_params)
    num_layers: int
    kv_heads: int
    head_dim: int
    head_params: int = 0  # the output head's weights (vocab x hidden), read once per pass
    moe: bool = False  # a mixture of experts: linear_params counts the experts one token reads (an estimate)

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelFacts:
        from leverlab.models.config import ModelConfig

        c = ModelConfig.from_folder(path)
        # A mixture-of-experts model's pass reads the weights its tokens route to, not all of them: the active
        # count (shared expert + top-k experts per sparse layer + attention + embeddings) is the estimate at one
        # sequence. A batch's tokens pick more distinct experts; predict_all uses the bytes the server measured
        # from the router's choices where it has them.
        linear = c.linear_params(active=True)
        return cls(linear, c.num_params(active=True) - linear, c.num_layers, c.num_kv_heads, c.head_dim,
                   c.vocab_size * c.hidden_size, c.is_moe)

    @property
    def num_params(self) -> int:
        return self.linear_params + self.other_params


def weight_bits(levers: Levers) -> float:
    if levers.quantization:
        return QUANT_BITS.get(levers.quantization, 8.0)
    return DTYPE_BITS.get(levers.dtype, 16)


def head_bits(levers: Levers) -> float:
    """The output head's storage bits: int8 under int8, int6 under int4 (the engine's default where its int6
    kernel streams: AVX-512 VNNI; int8 elsewhere, where this overestimates the speed by the head's 1.5 bits), its
    own method's for int4+head and int6, the model dtype otherwise (fp8, AWQ/GPTQ keep it)."""
    q = levers.quantization or ""
    if q == "int4+head":
        return QUANT_BITS["int4"]
    if q.startswith(("int4", "int6")):
        return QUANT_BITS["int6"]
    if q.startswith("int8"):
        return QUANT_BITS["int8"]
    return DTYPE_BITS.get(levers.dtype, 16)


def kv_bytes_per_token(facts: ModelFacts, levers: Levers) -> float:
    """K and V of one token over all layers. int8/fp8: one byte per element + a 4-byte scale per head."""
    per_head = (
        facts.head_dim + 4
        if levers.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3")
        else facts.head_dim * DTYPE_BITS[levers.dtype] / 8
    )
    return facts.num_layers * 2 * facts.kv_heads * per_head


def bytes_per_pass(facts: ModelFacts, levers: Levers, context: float, batch: int = 1,
                   weights: float | None = None) -> float:
    """weights: the weight bytes per pass the server measured (a mixture of experts' router-counted reads: already
    at this precision and rank 0's share), in place of the estimate from the model's facts."""
    if weights is None:
        weights = (
            facts.linear_params * weight_bits(levers) / 8
            + facts.head_params * head_bits(levers) / 8
            + (facts.other_params - facts.head_params) * DTYPE_BITS[levers.dtype] / 8
        )
        # Tensor parallelism splits the weight reads over devices (each reads 1/tp of them, in parallel).
        weights /= max(1, levers.tensor_parallel_size)
    return weights + batch * context * kv_bytes_per_token(facts, levers)


def weight_bytes_source(facts: ModelFacts, measured: float | None) -> str:
    """How a row's weight bytes were found: "measured" (the server counted a mixture of experts' reads), "estimate"
    (a mixture of experts without that count: top-k experts per token), "model" (a dense model: every weight)."""
    return "measured" if measured else "estimate" if facts.moe else "model"


def tokens_per_pass(generated: float | None, accepted: float | None) -> float:
    if not generated or not accepted:
        return 1.0
    return generated / max(1.0, generated - accepted)


def predict_all(
    configs: list[dict[str, Any]],
    facts: ModelFacts,
    bandwidth_gbs: float,
    context: float,
    batch: int = 1,
    facts_of: Any = None,
) -> dict[str, dict[str, Any]]:
    """configs: [{name, parent, levers: Levers, measured_decode_tok_s, generated, accepted}] in plan order,
    the first being the baseline; optionally allreduce_s_per_pass (measured, tensor parallel); optionally generated_load / accepted_load / measured_rps_load (the counters
    and requests/s at concurrency `batch`); optionally weight_bytes_per_pass / weight_bytes_per_pass_load (a
    mixture of experts' weight bytes per decode pass as the server counted them, at one stream and at `batch`).
    Returns name -> prediction (missing measurements give None).

    Under load the model predicts only a ratio against the parent: B sequences share one weight read, so
    throughput ~ tokens_per_pass(B) / bytes_per_pass(B), where bytes grow with B's KV caches."""
    bw = bandwidth_gbs * 1e9
    out: dict[str, dict[str, Any]] = {}
    base = configs[0]
    base_f = facts_of(base["levers"]) if facts_of else facts
    base_bytes = bytes_per_pass(base_f, base["levers"], context, weights=base.get("weight_bytes_per_pass"))
    base_meas = base.get("measured_decode_tok_s")
    base_tpp = tokens_per_pass(base.get("generated"), base.get("accepted"))
    # t_fixed: the part of the baseline's pass time that the bytes do not explain.
    t_fixed = None
    if base_meas and base_meas > 0:
        t_fixed = max(0.0, base_tpp / base_meas - base_bytes / bw)
    levers_by_name: dict[str, Levers] = {}
    for c in configs:
        lv: Levers = c["levers"]
        f = facts_of(lv) if facts_of else facts  # the model lever serves another model: its own bytes
        measured_w = c.get("weight_bytes_per_pass")
        b = bytes_per_pass(f, lv, context, weights=measured_w)
        tpp = tokens_per_pass(c.get("generated"), c.get("accepted"))
        roof = tpp * bw / b
        t_comm = c.get("allreduce_s_per_pass") or 0.0  # measured all-reduce seconds per pass (TP only)
        calibrated = tpp / (t_fixed + b / bw + t_comm) if t_fixed is not None else None
        meas = c.get("measured_decode_tok_s")
        p = {
            "bytes_per_pass": b,
            "weight_bytes_source": weight_bytes_source(f, measured_w),
            "weight_bits": weight_bits(lv),
            "byte_ratio_vs_baseline": base_bytes / b,
            "tokens_per_pass": tpp,
            "roofline_tok_s": roof,
            "calibrated_tok_s": calibrated,
            "t_fixed_ms": None if t_fixed is None else t_fixed * 1e3,
            "t_bytes_ms": b / bw * 1e3,
            "t_allreduce_ms": t_comm * 1e3 if c.get("allreduce_s_per_pass") is not None else None,
            "measured_decode_tok_s": meas,
            "roofline_share": (meas / roof) if meas else None,
        }
        tpp_load = tokens_per_pass(c.get("generated_load"), c.get("accepted_load"))
        p["tokens_per_pass_load"] = tpp_load
        w_load = c.get("weight_bytes_per_pass_load")
        p["load_rate_index"] = tpp_load / bytes_per_pass(f, lv, context, batch, weights=w_load)  # relative only
        p["load_weight_bytes_source"] = weight_bytes_source(f, w_load)
        p["measured_rps_load"] = c.get("measured_rps_load")
        parent = out.get(c.get("parent") or "")
        if parent:
            p["predicted_load_speedup_vs_parent"] = p["load_rate_index"] / parent["load_rate_index"]
            pr = parent.get("measured_rps_load")
            p["measured_load_speedup_vs_parent"] = (
                (p["measured_rps_load"] / pr) if (pr and p["measured_rps_load"]) else None
            )
            p["predicted_speedup_vs_parent"] = (
                (calibrated / parent["calibrated_tok_s"])
                if (calibrated and parent.get("calibrated_tok_s"))
                else roof / parent["roofline_tok_s"]
            )
            p["roofline_speedup_vs_parent"] = roof / parent["roofline_tok_s"]
            pm = parent.get("measured_decode_tok_s")
            p["measured_speedup_vs_parent"] = (meas / pm) if (meas and pm) else None
        parent_lv = levers_by_name.get(c.get("parent") or "")
        changed = lv.changed_levers(parent_lv) if parent_lv is not None else []
        p["gap"] = explain_gap(p, changed[0] if len(changed) == 1 else None)
        out[c["name"]] = p
        levers_by_name[c["name"]] = lv
    return out


def explain_gap(p: dict[str, Any], lever: str | None) -> str | None:
    """A sentence when measured and predicted differ by more than GAP_THRESHOLD, else None. lever: the one
    lever this configuration changed from its parent (what the speedup gap is about)."""
    meas = p.get("measured_decode_tok_s")
    if not meas:
        return None
    notes = []
    share = p["roofline_share"]
    if share is not None and share < 1 - GAP_THRESHOLD:
        tf, tb = p.get("t_fixed_ms"), p["t_bytes_ms"]
        if tf is not None:
            notes.append(
                f"reaches {share:.0%} of the bandwidth roofline: reading the bytes takes {tb:.2f} ms per pass, "
                f"the fixed per-pass cost (scheduling, kernel dispatch, sampling, streaming) about {tf:.2f} ms; "
                "the model is too small for its decode to be bandwidth-bound here"
            )
    elif share is not None and share > 1 + GAP_THRESHOLD:
        notes.append(
            f"exceeds the DRAM roofline ({share:.0%}): {p['bytes_per_pass'] / 1e6:.0f} MB per pass partly stays in "
            "the CPU caches, which are faster than the measured memory bandwidth"
        )
    ms, ps = p.get("measured_speedup_vs_parent"), p.get("predicted_speedup_vs_parent")
    if ms and ps and not math.isclose(ms, ps, rel_tol=GAP_THRESHOLD):
        if lever == "precision" and ms < ps:
            notes.append(
                f"speedup {ms:.2f}x against {ps:.2f}x predicted: the quantized matmuls unpack and rescale "
                "weights on the fly, which costs compute the bandwidth model does not count"
            )
        elif lever == "tensor_parallel" and ms < ps:
            ar = p.get("t_allreduce_ms")
            notes.append(
                f"speedup {ms:.2f}x against {ps:.2f}x predicted: on one CPU the ranks share one memory system, so "
                "splitting the weights adds no bandwidth"
                + (f", and each pass spends {ar:.2f} ms in all-reduces" if ar else "")
            )
        elif lever == "speculation" and ms < ps:
            notes.append(
                f"speedup {ms:.2f}x against {ps:.2f}x predicted: a verify pass over K+1 tokens costs more than a "
                "one-token pass on a CPU (compute, not bytes), and proposing and rolling back cost time"
            )
        elif ms > ps:
            notes.append(
                f"speedup {ms:.2f}x beats the {ps:.2f}x predicted (noise on a shared machine, or caches)"
            )
        else:
            notes.append(f"speedup {ms:.2f}x against {ps:.2f}x predicted")
    ml, pl = p.get("measured_load_speedup_vs_parent"), p.get("predicted_load_speedup_vs_parent")
    if ml and pl and not math.isclose(ml, pl, rel_tol=GAP_THRESHOLD):
        notes.append(
            f"under load {ml:.2f}x against {pl:.2f}x from bytes: a batch shares one weight read, so a batched "
            "CPU decode is bound by compute and scheduling more than by bytes"
            + (" (and a noisy shared machine)" if ml > pl else "")
        )
    return "; ".join(notes) or None
