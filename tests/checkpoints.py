"""Tiny random Hugging Face checkpoints, made by the tests themselves (nothing is downloaded).

`make_checkpoint(path, arch)` writes a real HF folder: config.json, sharded *.safetensors with an index,
tokenizer.json / tokenizer_config.json (a byte-level BPE trained here, with a ChatML chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_TRAIN_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]


def make_tokenizer(path: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAIN_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10_000.0)
    elif arch == "llama":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "mistral":  # sliding window on every layer
        cfg = MistralConfig(**common, tie_word_embeddings=False, rope_theta=10_000.0, sliding_window=8)
    elif arch == "qwen2-window":  # sliding window on layers >= max_window_layers only
        cfg = Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1)
    elif arch == "llama-tied":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10_000.0)
    else:
        raise ValueError(arch)
    return cfg


ARCHS = ("qwen3", "qwen2", "llama", "llama-tied")


def make_checkpoint(path: Path, arch: str = "qwen3", seed: int = 0, shards: bool = True, **overrides) -> Path:
    """Write a tiny random checkpoint of `arch` to `path` and return it. Weights are float32."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = _config(arch, vocab_size=len(vocab), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init draws small weights; widen them so logits are far from uniform and greedy is decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" not in name else 0.2)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path), max_shard_size="40KB" if shards else "10GB", safe_serialization=True)
    return path


def make_eagle_head(target: str | Path, out: str | Path, seed: int = 1, std: float = 0.15) -> str:
    """A randomly initialized EAGLE head for `target` (float32): drafts mostly rejected, which exercises
    verification and rollback; exactness never depends on the head."""
    from leverlab.models.config import ModelConfig
    from leverlab.spec.eagle_head import EagleConfig, EagleHead, init_head, save_head

    head = init_head(EagleHead(EagleConfig.for_target(ModelConfig.from_folder(target))), seed=seed, std=std)
    save_head(head, out, dtype="float32")
    return str(out)
