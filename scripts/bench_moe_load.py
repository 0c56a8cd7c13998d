"""What hundreds of per-expert Linear layers cost at load (issue 61): load_model's seconds for a Qwen3-MoE
checkpoint in bf16, int8 and int4, and one greedy decode's tokens/s after it, in one run.

Each expert's projections are our Linear layers (models/moe.py), so a Qwen3-30B-A3B-shaped model has 48 x 128 x 2
= 12,288 of them beside 96 attention ones. Two checkpoints tell the two costs apart:
  many   tiny matrices, many layers and experts (default 48 layers x 128 experts, hidden and width 64): the cost per layer
         object (building it, attaching its method, loading and converting its tensors, the load-time tuning);
  shape  the real Qwen3-30B-A3B expert shape (hidden 2048, 128 experts of width 768, 8 active) in 1 layer: the
         cost per byte of the expert weights, and greedy decode rates (16-token prompts, 32 new tokens) of one
         stream and of 16 sequences at once (aggregate), through the module path's grouped experts.
Weights are random bf16, written here straight to safetensors (per-expert names, as published checkpoints have).

    python scripts/bench_moe_load.py [--out /tmp/moe-load] [--layers 48] [--experts 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_checkpoint(path: Path, layers: int, experts: int, hidden: int, inter: int, top_k: int, heads: int,
                     kv_heads: int, head_dim: int) -> Path:
    from safetensors.torch import save_file

    from tests.checkpoints import make_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    tj = json.loads((path / "tokenizer.json").read_text())
    vocab = 1 + max([*tj["model"]["vocab"].values(), *(t["id"] for t in tj["added_tokens"])])
    g = torch.Generator().manual_seed(0)

    def w(*shape, std=0.05):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden, std=0.2), "lm_head.weight": w(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "mlp.gate.weight": w(experts, hidden, std=0.5),
        })
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            tensors.update({q + "gate_proj.weight": w(inter, hidden), q + "up_proj.weight": w(inter, hidden),
                            q + "down_proj.weight": w(hidden, inter)})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 4 * inter, "moe_intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eos_token_id": 0, "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def time_loads(path: Path, label: str, decode: bool) -> None:
    from leverlab import LLM, SamplingParams
    from leverlab.layers.linear import Linear
    from leverlab.models.loader import load_model

    for quant in (None, "int8", "int4"):
        t0 = time.perf_counter()
        model = load_model(path, "bfloat16", quantization=quant)
        seconds = time.perf_counter() - t0
        linears = sum(isinstance(m, Linear) for m in model.modules())
        line = f"{label:6s} {quant or 'bf16':5s} load {seconds:6.2f} s  {linears} Linear layers  " \
               f"{1e3 * seconds / linears:.3f} ms per layer"
        del model
        if decode:
            llm = LLM(str(path), dtype="bfloat16", quantization=quant)
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
            for n in (1, 16):  # one stream, then 16 sequences whose tokens share the hit experts' reads
                prompts = [list(range(5 + i, 21 + i)) for i in range(n)]
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                line += f"  x{n} {n * params.max_tokens / (time.perf_counter() - t0):.1f} tok/s"
            del llm
        print(line, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/moe-load")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    a = p.parse_args()
    out = Path(a.out)
    t0 = time.perf_counter()
    many = write_checkpoint(out / "many", a.layers, a.experts, hidden=64, inter=64, top_k=8, heads=4, kv_heads=2,
                            head_dim=16)
    shape = write_checkpoint(out / "shape", 1, a.experts, hidden=2048, inter=768, top_k=8, heads=32, kv_heads=4,
                             head_dim=128)
    print(f"checkpoints written in {time.perf_counter() - t0:.1f} s; threads {torch.get_num_threads()}", flush=True)
    time_loads(many, "many", decode=False)
    time_loads(shape, "shape", decode=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
