"""The EAGLE head's training loss with "training-time test" (EAGLE-3): the head is unrolled on its own outputs
exactly as it drafts, so draft positions 2..K are trained on the inputs they will see when serving.

Window ids [B, N]; the target gives aux features f_i and its distribution p_i (predicting x_{i+1}) at every i.
Step 0, base row i = 0..N-2: feature fc(f_i), token x_{i+1}, position i -> h0_i, which must predict x_{i+2}
(label: p_{i+1}). Step j, base row i: feature h{j-1}_i (the head's own output), token x_{i+1+j}, position
i + j -> hj_i predicting x_{i+2+j} (label p_{i+1+j}); rows run out j positions early.

Attention matches serving: the step-j query of base i sees the step-0 keys of rows <= i (real features, in
the head's KV cache when serving) plus the keys of steps 1..j of the same base (the draft rows fed back
before it). So each step adds one "diagonal" key per row next to the causal block.

Loss: soft cross-entropy against the target's distribution (its top-1 is what greedy verification
accepts), step j weighted by decay**j. Shapes: B windows, L_j = N - 1 - j rows at step j, H hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_forward(head, target, features_fn, ids: torch.Tensor, steps: int, decay: float = 0.8,
                loss_frac: float = 1.0, generator: torch.Generator | None = None):
    """-> (weighted loss, {"loss_j": ..., "acc_j": top-1 agreement with the target at step j})."""
    b, n = ids.shape
    aux, t_logits = features_fn(ids)  # [B, N, A*H], [B, N, V]
    t_probs = torch.softmax(t_logits, dim=-1)
    t_top = t_logits.argmax(dim=-1)
    with torch.no_grad():
        embeds = target.model.embed_tokens(ids)  # [B, N, H]; the target's, frozen
    nh, nkv, hd = head.nh, head.nkv, head.hd
    group = nh // nkv
    keys, values = [], []  # per step: [B, nkv, L_j, D]
    total = torch.zeros((), device=ids.device)
    stats: dict[str, float] = {}
    feats = head.fuse(aux[:, : n - 1])  # [B, L_0, H]
    for j in range(steps):
        lj = n - 1 - j
        if lj < 1:
            break
        feats = feats[:, :lj]
        pos = (torch.arange(lj, device=ids.device) + j).repeat(b)
        q, k, v = head.project(pos, embeds[:, 1 + j : 1 + j + lj].reshape(b * lj, -1), feats.reshape(b * lj, -1))
        q = q.view(b, lj, nh, hd).transpose(1, 2)  # [B, nh, L_j, D]
        keys.append(k.view(b, lj, nkv, hd).transpose(1, 2))
        values.append(v.view(b, lj, nkv, hd).transpose(1, 2))

        def heads(x):  # [B, nkv, L, D] -> [B, nh, L, D] (grouped-query attention)
            return x.repeat_interleave(group, dim=1) if group > 1 else x

        k0, v0 = heads(keys[0][:, :, :lj]), heads(values[0][:, :, :lj])
        scores = torch.matmul(q, k0.transpose(-1, -2)).float() * head.scale  # [B, nh, L_j, L_j]
        causal = torch.ones(lj, lj, dtype=torch.bool, device=ids.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [((q * heads(keys[s][:, :, :lj])).sum(-1, keepdim=True)).float() * head.scale for s in range(1, j + 1)]
        w = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1).to(q.dtype)
        out = torch.matmul(w[..., :lj], v0)
        for s in range(1, j + 1):
            out = out + w[..., lj + s - 1 : lj + s] * heads(values[s][:, :, :lj])
        h = head.finish(feats.reshape(b * lj, -1), out.transpose(1, 2).reshape(b * lj, nh, hd)).view(b, lj, -1)

        labels = t_probs[:, 1 + j : 1 + j + lj].reshape(b * lj, -1)
        top = t_top[:, 1 + j : 1 + j + lj].reshape(-1)
        rows = h.reshape(b * lj, -1)
        if loss_frac < 1.0:  # the shared lm_head dominates the cost: score a random subset of rows
            keep = torch.randperm(b * lj, generator=generator)[: max(1, int(b * lj * loss_frac))].to(ids.device)
            rows, labels, top = rows[keep], labels[keep], top[keep]
        logits = target.compute_logits(head.norm(rows))  # [R, V] float32
        loss = -(labels * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + decay**j * loss
        stats[f"loss_{j}"] = loss.item()
        stats[f"acc_{j}"] = (logits.argmax(-1) == top).float().mean().item()
        feats = h  # the next step's feature: the head's own output, as when drafting
    return total, stats


def expected_accepted(accs: list[float]) -> float:
    """Drafts accepted per verify step if position j is accepted with probability acc_j given the earlier
    ones were (a rough figure from top-1 agreement): sum over j of prod_{s<=j} acc_s."""
    total, run = 0.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total
