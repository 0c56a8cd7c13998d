"""Write a random-weight checkpoint shaped exactly like Qwen3-0.6B (bf16), for the benchmarks.

Usage: python scripts/make_qwen3_06b_shape.py [OUT_DIR]   (default .cache/qwen3-0.6b-shape; skipped if present)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make(out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.checkpoints import make_tokenizer

    cfg = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, eos_token_id=151645,
        bos_token_id=151643, dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    model.tie_weights()  # to_empty() untied them: tied like the real Qwen3-0.6B, so both engines run one model
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    # A small byte-level tokenizer stands in for Qwen's; the benchmarks feed token ids.
    make_tokenizer(out)
    return out


if __name__ == "__main__":
    # argparse, not sys.argv: `--help` had been taken for the output folder and a folder of that name written.
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / ".cache" / "qwen3-0.6b-shape",
                    help="output folder (default .cache/qwen3-0.6b-shape; skipped if it holds a config.json)")
    print(make(ap.parse_args().out))
