"""Shapes of the bundled target (~15M parameters) and draft (~1.5M) models: Qwen3, vocab 8192, tied embeddings."""

from __future__ import annotations

from transformers import Qwen3Config

from leverlab.train.tokenizer import MODEL_MAX_LENGTH, VOCAB_SIZE

TARGET_NAME = "leverlab-code-15m"
DRAFT_NAME = "leverlab-code-draft"
EOT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


def _config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,  # GQA: fewer KV heads than query heads
        head_dim=64,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
    )


def target_config() -> Qwen3Config:
    # 8 layers x (attention 393k + MLP 1.18M) + tied embedding 3.1M = 15.7M parameters.
    return _config(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024)


def draft_config() -> Qwen3Config:
    # Tied embedding 1.05M + 2 layers x 197k = 1.4M parameters: about a tenth of the target.
    return _config(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384)


def count_params(model) -> int:
    # Tied weights are one tensor, so parameters() counts the embedding once.
    return sum(p.numel() for p in model.parameters())
