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
# Qwen3's thinking template, cut down: with enable_thinking false the prompt closes an empty think block, as
# Qwen3's does; otherwise the model starts its answer with its reasoning.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
THINK_TAGS = ["<think>", "</think>"]

_TRAIN_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]


def make_tokenizer(path: Path, vocab_size: int = 384, think_tags: bool = False) -> None:
    """think_tags: <think> and </think> as single added tokens that are not special (they stay in the
    decoded text, as in Qwen3's tokenizer), and THINK_TEMPLATE as the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
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
    if think_tags:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = THINK_TEMPLATE if think_tags else CHAT_TEMPLATE
    fast.save_pretrained(str(path))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _config(arch: str, vocab_size: int, rope_scaling: dict | None = None, **overrides):
    """rope_scaling: the checkpoint's rope scaling dict (None: each arch's own, Llama 3's for llama)."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

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
    common.update(MOE_OVERRIDES.get(arch, {}))
    common.update(overrides)
    if rope_scaling is not None:
        common["rope_scaling"] = dict(rope_scaling)
    if arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10_000.0)
    elif arch == "llama":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500_000.0,
            **({} if rope_scaling is not None else {"rope_scaling": dict(LLAMA3_ROPE)}),
        )
    elif arch == "mistral":  # sliding window on every layer
        cfg = MistralConfig(**common, tie_word_embeddings=False, rope_theta=10_000.0, sliding_window=8)
    elif arch == "qwen2-window":  # sliding window on layers >= max_window_layers only
        cfg = Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1)
    elif arch == "llama-tied":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10_000.0)
    # Mixtures of experts: 8 experts, 2 per token (MOE_OVERRIDES may change any of it).
    elif arch == "qwen3-moe":
        cfg = Qwen3MoeConfig(**common, head_dim=32, rope_theta=1_000_000.0)
    elif arch == "qwen2-moe":  # a shared expert; layer 1 dense (mlp_only_layers), at intermediate_size
        cfg = Qwen2MoeConfig(**common, rope_theta=10_000.0)
    elif arch == "mixtral":
        cfg = MixtralConfig(**common, rope_theta=1_000_000.0)
    else:
        raise ValueError(arch)
    return cfg


ARCHS = ("qwen3", "qwen2", "llama", "llama-tied")
MOE_ARCHS = ("qwen3-moe", "qwen2-moe", "mixtral")
# The MoE facts of each tiny MoE checkpoint (make_checkpoint's overrides win over these).
MOE_OVERRIDES = {
    "qwen3-moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      num_hidden_layers=3, tie_word_embeddings=False),
    "qwen2-moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, num_hidden_layers=3,
                      mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, num_hidden_layers=2,
                    tie_word_embeddings=False),
}


def make_checkpoint(path: Path, arch: str = "qwen3", seed: int = 0, shards: bool = True, think_tags: bool = False,
                    rope_scaling: dict | None = None, **overrides) -> Path:
    """Write a tiny random checkpoint of `arch` to `path` and return it. Weights are float32.
    think_tags: the tokenizer and template of make_tokenizer(think_tags=True).
    rope_scaling: a rope scaling dict (linear, dynamic, yarn, longrope ...) in place of the arch's own."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, think_tags=think_tags)
    tj = json.loads((path / "tokenizer.json").read_text())
    size = 1 + max([*tj["model"]["vocab"].values(), *(t["id"] for t in tj["added_tokens"])])
    cfg = _config(arch, vocab_size=size, rope_scaling=rope_scaling, **overrides)
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
    from leverlab.speculative.eagle_head import EagleConfig, EagleHead, init_head, save_head

    head = init_head(EagleHead(EagleConfig.for_target(ModelConfig.from_folder(target))), seed=seed, std=std)
    save_head(head, out, dtype="float32")
    return str(out)


def make_speculators_eagle3(target: str | Path, out: str | Path, draft_vocab: int | None = 96, seed: int = 2,
                            layer_ids: list[int] | None = None, layer_type: str = "llama",
                            original: bool = False, norm_before_residual: bool | None = True,
                            std: float = 0.15, switches: dict | None = None) -> str:
    """An EAGLE-3 head for `target` with random weights, written the way the `speculators` library (or, with
    `original`, the EAGLE-3 release) writes it: its config keys and tensor names, its own lm_head over a
    reduced draft vocabulary of `draft_vocab` target ids with d2t offsets and the t2d mask. Written here
    from the format's description, not with our exporter, so that reading it tests our reader."""
    import torch
    from safetensors.torch import save_file

    target, out = Path(target), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t = json.loads((target / "config.json").read_text())
    h, layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    d = t.get("head_dim") or h // heads
    inter = 96
    ids = layer_ids if layer_ids is not None else list(range(1, min(layers, 4)))  # vLLM ids: stream entering layer i
    vd = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    def ones(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    pre = "midlayer." if original else "layers.0."
    tensors = {
        "fc.weight": w(h, len(ids) * h),
        pre + "input_layernorm.weight": ones(h),
        pre + "hidden_norm.weight": ones(h),
        pre + "self_attn.q_proj.weight": w(heads * d, 2 * h),
        pre + "self_attn.k_proj.weight": w(kv * d, 2 * h),
        pre + "self_attn.v_proj.weight": w(kv * d, 2 * h),
        pre + "self_attn.o_proj.weight": w(h, heads * d),
        pre + "post_attention_layernorm.weight": ones(h),
        pre + "mlp.gate_proj.weight": w(inter, h),
        pre + "mlp.up_proj.weight": w(inter, h),
        pre + "mlp.down_proj.weight": w(h, inter),
        "norm.weight": ones(h),
        "lm_head.weight": w(vd, h) * 3,
    }
    switches = dict(switches or {})  # norm_before_fc / fc_norm / norm_output, with their tensors
    if switches.get("norm_before_fc"):
        tensors["input_norm.weight"] = ones(len(ids) * h)
    if switches.get("fc_norm"):
        for i in range(len(ids)):
            tensors[f"fc_norm.{i}.weight"] = ones(h)
    if layer_type == "qwen3":
        tensors[pre + "self_attn.q_norm.weight"] = ones(d)
        tensors[pre + "self_attn.k_norm.weight"] = ones(d)
    if vd != vocab:
        # The draft vocabulary: a random set of target ids, in increasing order (as speculators builds it from
        # token frequencies); d2t holds the offset from each draft id to its target id.
        targets = torch.sort(torch.randperm(vocab, generator=g)[:vd]).values
        tensors["d2t"] = targets - torch.arange(vd)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    layer = {"model_type": layer_type, "architectures": ["LlamaForCausalLM"], "hidden_size": h,
             "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
             "num_key_value_heads": kv, "head_dim": d, "hidden_act": "silu", "rms_norm_eps": 1e-6,
             "rope_theta": t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 10000.0),
             "rope_scaling": None, "max_position_embeddings": t["max_position_embeddings"],
             "attention_bias": False, "mlp_bias": False, "vocab_size": vocab, "tie_word_embeddings": False}
    if original:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vd,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        if norm_before_residual is not None:
            config["norm_before_residual"] = norm_before_residual
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0", "transformer_layer_config": layer, "draft_vocab_size": vd,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": ids, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False, **switches,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": str(target), "architectures": t["architectures"]}},
            "torch_dtype": "float32",
        }
        if norm_before_residual is not None:
            config["norm_before_residual"] = norm_before_residual
        save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(out)


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, ref: str | None = "main", commit: str | None = None) -> Path:
    """Put `folder`'s files into a Hugging Face Hub cache at `cache` in the Hub's own layout, as
    `huggingface_hub` leaves a download: models--ORG--NAME/blobs/<hash> (the content),
    snapshots/<commit>/<file> (relative symlinks to the blobs) and refs/<ref> (the commit). Returns the
    snapshot folder. `commit`: the snapshot's 40-hex name (default: a hash of the files)."""
    import hashlib
    import os

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    if commit is None:
        h = hashlib.sha1()
        for f in files:
            h.update(f.name.encode() + f.read_bytes())
        commit = h.hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for f in files:
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap
