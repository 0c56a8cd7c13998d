"""Stage `draft`: distill the ~1.5M-parameter draft from the target's output distribution.

Loss = alpha * T^2 * KL(p_target(T) || p_draft(T)) + (1 - alpha) * CE(draft, data). The draft exists to propose
tokens the target will accept, so what matters is top-1 agreement; we default to T = 1 (a higher temperature
spends the tiny draft's capacity on the target's low-probability tail) and log the agreement as it trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from leverlab import env
from leverlab.train.data import load_tokens
from leverlab.train.model_configs import count_params, draft_config, target_config
from leverlab.train.paths import Paths
from leverlab.train.trainer import TrainSettings, autocast, train


def load_target_from_run(paths: Paths, device: torch.device) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(target_config())
    saved = torch.load(paths.target_run / "ckpt.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(saved["model"])
    return model.to(device).eval()


def make_distill_loss(teacher: torch.nn.Module, temperature: float, alpha: float):
    for p in teacher.parameters():
        p.requires_grad_(False)

    def loss_fn(student: torch.nn.Module, x: torch.Tensor):
        inp, tgt = x[:, :-1], x[:, 1:].flatten()
        with torch.no_grad(), autocast(x.device):
            t_logits = teacher(input_ids=inp).logits.float().flatten(0, 1)  # [B*L, V]
        with autocast(x.device):
            s_logits = student(input_ids=inp).logits.float().flatten(0, 1)
        t_logp = F.log_softmax(t_logits / temperature, dim=-1)
        s_logp = F.log_softmax(s_logits / temperature, dim=-1)
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * temperature**2
        ce = F.cross_entropy(s_logits, tgt)
        agree = (s_logits.argmax(-1) == t_logits.argmax(-1)).float().mean().item()
        return alpha * kl + (1 - alpha) * ce, {"kl": kl.item(), "ce": ce.item(), "top1_agree": agree}

    return loss_fn


def distill_draft(
    paths: Paths, settings: TrainSettings, resume: bool = True, temperature: float = 1.0, alpha: float = 0.9
) -> dict:
    torch.manual_seed(settings.seed + 1)
    device = env.pick_device(settings.device)
    torch.set_num_threads(settings.threads)
    teacher = load_target_from_run(paths, device)
    student = Qwen3ForCausalLM(draft_config())
    print(f"draft: {count_params(student):,} parameters; teacher {count_params(teacher):,}", flush=True)
    return train(
        student,
        make_distill_loss(teacher, temperature, alpha),
        load_tokens(paths.data, "train"),
        load_tokens(paths.data, "val"),
        paths.draft_run,
        settings,
        resume=resume,
    )
