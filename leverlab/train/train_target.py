"""Stage `target`: train the ~15M-parameter Qwen3 target on the train split with next-token cross-entropy."""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from leverlab.train.data import load_tokens
from leverlab.train.model_configs import count_params, target_config
from leverlab.train.paths import Paths
from leverlab.train.trainer import TrainSettings, ce_loss, train


def train_target(paths: Paths, settings: TrainSettings, resume: bool = True) -> dict:
    torch.manual_seed(settings.seed)
    model = Qwen3ForCausalLM(target_config())
    print(f"target: {count_params(model):,} parameters", flush=True)
    return train(
        model,
        ce_loss,
        load_tokens(paths.data, "train"),
        load_tokens(paths.data, "val"),
        paths.target_run,
        settings,
        resume=resume,
    )
