from __future__ import annotations

import pytest

from leverlab.study.plan import Levers
from leverlab.study.predict import (
    ModelFacts,
    bytes_per_pass,
    kv_bytes_per_token,
    predict_all,
    tokens_per_pass,
    weight_bits,
)

FACTS = ModelFacts(linear_params=1_000_000, other_params=200_000, num_layers=2, kv_heads=2, head_dim=64)


def test_weight_bits():
    assert weight_bits(Levers()) == 16
    assert weight_bits(Levers(dtype="float32")) == 32
    assert weight_bits(Levers(quantization="int4")) == pytest.approx(4.5)  # 4 bits + 32 bits per 64 weights
    assert weight_bits(Levers(quantization="int4-g128")) == pytest.approx(4.25)


def test_bytes_per_pass_counts_weights_head_and_kv():
    # bf16: 1M * 2 + 0.2M * 2 bytes of weights; KV: 2 layers * (K,V) * 2 heads * 64 * 2 bytes = 1024 B/token
    assert kv_bytes_per_token(FACTS, Levers()) == 1024
    assert bytes_per_pass(FACTS, Levers(), context=100) == 2_400_000 + 102_400
    # int8 KV: 64 + 4 bytes per head instead of 128
    assert kv_bytes_per_token(FACTS, Levers(kv_cache_dtype="int8")) == 2 * 2 * 2 * 68
    # int4 weights: the head/embedding stays in bf16
    assert bytes_per_pass(FACTS, Levers(quantization="int4"), 0) == pytest.approx(
        1_000_000 * 4.5 / 8 + 400_000
    )
    # TP=2 halves the weight reads per device
    assert bytes_per_pass(FACTS, Levers(tensor_parallel_size=2), 0) == 1_200_000


def test_tokens_per_pass_from_counters():
    assert tokens_per_pass(None, None) == 1.0
    assert tokens_per_pass(100, 0) == 1.0
    assert tokens_per_pass(100, 50) == 2.0  # 50 passes made 100 tokens


def test_predictions_roofline_and_calibrated():
    bw = 10.0  # GB/s
    configs = [
        {"name": "base", "parent": None, "levers": Levers(), "measured_decode_tok_s": 1000.0},
        {
            "name": "int8",
            "parent": "base",
            "levers": Levers(quantization="int8"),
            "measured_decode_tok_s": 1500.0,
        },
        {
            "name": "ng",
            "parent": "int8",
            "levers": Levers(quantization="int8", speculative={"method": "ngram"}),
            "measured_decode_tok_s": 1200.0,
            "generated": 100,
            "accepted": 20,
        },
    ]
    p = predict_all(configs, FACTS, bw, context=0)
    b0 = 2_400_000
    assert p["base"]["roofline_tok_s"] == pytest.approx(10e9 / b0)
    # the fixed cost is what the bytes do not explain of the baseline's 1 ms per token
    t_fixed = 1e-3 - b0 / 10e9
    assert p["base"]["t_fixed_ms"] == pytest.approx(t_fixed * 1e3)
    assert p["base"]["calibrated_tok_s"] == pytest.approx(1000.0)
    b8 = 1_000_000 * weight_bits(Levers(quantization="int8")) / 8 + 400_000
    assert p["int8"]["calibrated_tok_s"] == pytest.approx(1 / (t_fixed + b8 / 10e9))
    assert p["int8"]["measured_speedup_vs_parent"] == pytest.approx(1.5)
    assert p["ng"]["tokens_per_pass"] == pytest.approx(1.25)
    assert p["ng"]["calibrated_tok_s"] == pytest.approx(1.25 / (t_fixed + b8 / 10e9))
    assert p["ng"]["predicted_speedup_vs_parent"] == pytest.approx(1.25)
    assert "verify pass" in p["ng"]["gap"]  # 0.8x measured against 1.25x predicted


def test_model_facts_from_a_checkpoint(checkpoint_factory):
    from leverlab.models.config import ModelConfig

    path = checkpoint_factory("qwen3")
    f = ModelFacts.from_folder(path)
    assert f.num_params == ModelConfig.from_folder(path).num_params()
    assert f.linear_params > 0 and f.other_params > 0


def test_model_facts_of_a_mixture_of_experts_count_the_active_experts(checkpoint_factory):
    from leverlab.models.config import ModelConfig

    c = ModelConfig.from_folder(checkpoint_factory("qwen3-moe"))  # 3 sparse layers, 8 experts, 2 per token
    f = ModelFacts.from_folder(checkpoint_factory("qwen3-moe"))
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 2 * 3 * h * c.moe_intermediate_size  # attention + two experts
    assert f.linear_params == c.num_layers * per_layer
    assert f.num_params == c.num_params(active=True) < c.num_params()
    assert f.moe and not ModelFacts.from_folder(checkpoint_factory("qwen3")).moe


def test_load_prediction_is_a_ratio_of_tokens_per_byte_at_the_batch():
    configs = [
        {"name": "base", "parent": None, "levers": Levers(), "measured_rps_load": 1.0},
        {
            "name": "ng",
            "parent": "base",
            "levers": Levers(speculative={"method": "ngram"}),
            "generated_load": 100,
            "accepted_load": 10,
            "measured_rps_load": 0.8,
        },
        {"name": "int8", "parent": "base", "levers": Levers(quantization="int8"), "measured_rps_load": 1.5},
    ]
    p = predict_all(configs, FACTS, 10.0, context=100, batch=16)
    assert p["ng"]["tokens_per_pass_load"] == pytest.approx(100 / 90)
    assert p["ng"]["predicted_load_speedup_vs_parent"] == pytest.approx(100 / 90)
    assert p["ng"]["measured_load_speedup_vs_parent"] == pytest.approx(0.8)
    b16 = bytes_per_pass(FACTS, Levers(), 100, 16)
    b16_8 = bytes_per_pass(FACTS, Levers(quantization="int8"), 100, 16)
    assert p["int8"]["predicted_load_speedup_vs_parent"] == pytest.approx(b16 / b16_8)


def test_tensor_parallel_prediction_pays_the_measured_allreduce():
    bw = 10.0
    base = {"name": "base", "parent": None, "levers": Levers(), "measured_decode_tok_s": 1000.0}
    tp = {"name": "tp2", "parent": "base", "levers": Levers(tensor_parallel_size=2), "measured_decode_tok_s": 500.0}
    free = predict_all([base, tp], FACTS, bw, context=0)["tp2"]
    paid = predict_all([base, {**tp, "allreduce_s_per_pass": 0.5e-3}], FACTS, bw, context=0)["tp2"]
    assert free["t_allreduce_ms"] is None and paid["t_allreduce_ms"] == pytest.approx(0.5)
    t_fixed = free["t_fixed_ms"] / 1e3
    assert paid["calibrated_tok_s"] == pytest.approx(1 / (t_fixed + 1_200_000 / 10e9 + 0.5e-3))
    assert paid["predicted_speedup_vs_parent"] < free["predicted_speedup_vs_parent"]
    assert "all-reduces" in paid["gap"]


def test_a_mixture_of_experts_uses_the_measured_weight_bytes_where_the_server_counted_them():
    """Measured weight bytes per pass (the router-counted reads) replace the estimate, KV added, no further split
    under TP (they are rank 0's share already); a row without them keeps the estimate, labelled as one."""
    moe = ModelFacts(linear_params=1_000_000, other_params=200_000, num_layers=2, kv_heads=2, head_dim=64, moe=True)
    base = {"name": "base", "parent": None, "levers": Levers(), "measured_decode_tok_s": 100.0,
            "weight_bytes_per_pass": 3_000_000.0, "weight_bytes_per_pass_load": 5_000_000.0}
    int8 = {"name": "int8", "parent": "base", "levers": Levers(quantization="int8"), "measured_decode_tok_s": 150.0}
    p = predict_all([base, int8], moe, 10.0, context=100, batch=4)
    assert p["base"]["bytes_per_pass"] == 3_000_000 + 102_400
    assert p["base"]["weight_bytes_source"] == "measured" and p["base"]["load_weight_bytes_source"] == "measured"
    assert p["base"]["load_rate_index"] == pytest.approx(1 / (5_000_000 + 4 * 102_400))
    assert p["base"]["roofline_tok_s"] == pytest.approx(10e9 / (3_000_000 + 102_400))
    assert p["int8"]["weight_bytes_source"] == "estimate"
    assert p["int8"]["bytes_per_pass"] == bytes_per_pass(moe, Levers(quantization="int8"), 100)
    assert bytes_per_pass(moe, Levers(tensor_parallel_size=2), 0, weights=1e6) == 1e6
    dense = predict_all([{**base, "weight_bytes_per_pass": None}], FACTS, 10.0, context=100)
    assert dense["base"]["weight_bytes_source"] == "model"
