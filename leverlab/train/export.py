"""Stage `export`: turn the latest checkpoints into Hugging Face folders under models/ (weights in bfloat16).

Each folder holds config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json
(with the chat template) and training-curve.png; the model card (README.md) is written by stage `card`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from leverlab.train.model_configs import EOT_ID, IM_END_ID, draft_config, target_config
from leverlab.train.paths import Paths
from leverlab.train.plot import plot_curve

# bf16 halves the repo size (target 31 MB instead of 63 MB); training kept fp32 master weights.
EXPORT_DTYPE = torch.bfloat16


def generation_config() -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=EOT_ID,
        eos_token_id=[EOT_ID, IM_END_ID],  # end of a file, or end of an assistant turn
        pad_token_id=EOT_ID,
        do_sample=False,
        max_new_tokens=256,
    )


def export_model(config: Qwen3Config, run_dir: Path, tokenizer_dir: Path, out_dir: Path, title: str) -> None:
    model = Qwen3ForCausalLM(config)
    saved = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(saved["model"])
    model = model.to(EXPORT_DTYPE).eval()
    model.generation_config = generation_config()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    plot_curve(run_dir, out_dir / "training-curve.png", title)
    print(f"exported {run_dir / 'ckpt.pt'} (step {saved['state']['step']}) -> {out_dir}", flush=True)


def export_all(paths: Paths) -> None:
    export_model(
        target_config(), paths.target_run, paths.tokenizer, paths.target_out, "leverlab-code-15m (target)"
    )
    if (paths.draft_run / "ckpt.pt").exists():
        export_model(
            draft_config(),
            paths.draft_run,
            paths.tokenizer,
            paths.draft_out,
            "leverlab-code-draft (distilled from the target)",
        )
