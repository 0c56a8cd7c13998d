"""Figures for an EAGLE head, measured through the engine itself, and its model card (README.md).

Acceptance: greedy generation on held-out prompts with the head at K drafts per step; per-position rates are
P(draft j accepted) per verify step. Speed: single stream (one request at a time), plain against eagle, same
prompts and lengths (greedy, ignore_eos), eager mode on the given threads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def measure(target: str, head_dir: str, prompts: list[list[int]], k: int, max_tokens: int, dtype: str,
            threads: int, speed_prompts: int = 4) -> dict:
    from leverlab import LLM, SamplingParams

    common = dict(dtype=dtype, execution_mode="eager", num_threads=threads)
    spec = LLM(target, speculative_config={"method": "eagle", "model": head_dir, "num_speculative_tokens": k},
               **common)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec.generate(prompts, params)
    c = spec.engine.counter_snapshot()
    steps = max(1, c["spec_verify_steps"])
    out = {
        "k": k, "prompts": len(prompts), "max_tokens": max_tokens, "dtype": dtype,
        "acceptance": c["spec_accepted_tokens"] / max(1, c["spec_draft_tokens"]),
        "per_position": [c[f"spec_accepted_pos_{j}"] / steps for j in range(k)],
        "tokens_per_step": 1 + c["spec_accepted_tokens"] / steps,
    }
    if speed_prompts:
        plain = LLM(target, **common)
        few = prompts[:speed_prompts]
        for llm in (plain, spec):  # warm both before timing
            llm.generate(few[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        times = {"plain": 0.0, "eagle": 0.0}
        for p in few:  # interleaved, so machine drift hits both alike
            for name, llm in (("plain", plain), ("eagle", spec)):
                t0 = time.perf_counter()
                llm.generate([p], params)
                times[name] += time.perf_counter() - t0
        tokens = len(few) * max_tokens
        out.update(plain_tok_s=tokens / times["plain"], eagle_tok_s=tokens / times["eagle"],
                   speedup=times["plain"] / times["eagle"], threads=threads)
    return out


def write_card(out_dir: Path, info: dict) -> None:
    """README.md (the model card) and eval.json (the figures) in the head folder."""
    (out_dir / "eval.json").write_text(json.dumps(info, indent=2) + "\n")
    m, t, cfg = info.get("measured") or {}, info["training"], info["config"]
    lines = [
        f"# EAGLE head for {info['target_name']}",
        "",
        f"A one-layer draft head (EAGLE-3 style) for `{info['target']}`: it reads the target's own hidden states "
        f"(outputs of decoder layers {cfg['aux_layer_ids']}, concatenated and projected by an fc) with the "
        "embedding of the next token, and drafts through the target's lm_head. The target's embedding and "
        "lm_head are shared, not stored here.",
        "",
        "```bash",
        f"leverlab serve {info['target']} --speculative-config "
        f"'{{\"method\": \"eagle\", \"model\": \"{info['out']}\", \"num_speculative_tokens\": {m.get('k', 3)}}}'",
        "```",
        "",
        "## Figures (held-out prompts, greedy)",
        "",
    ]
    if m:
        lines += [
            "| K | acceptance | accepted per position | tokens per target pass | single-stream speedup |",
            "|---|---|---|---|---|",
            f"| {m['k']} | {m['acceptance']:.0%} | {' / '.join(f'{r:.0%}' for r in m['per_position'])} | "
            f"{m['tokens_per_step']:.2f} | "
            + (f"{m['speedup']:.2f}x ({m['plain_tok_s']:.0f} -> {m['eagle_tok_s']:.0f} tok/s, "
               f"{m['threads']} thread(s), {m['dtype']}, eager)" if "speedup" in m else "-") + " |",
            "",
            f"{m['prompts']} held-out prompts, {m['max_tokens']} tokens each. Acceptance is accepted / drafted "
            "tokens; position j is the share of verify steps whose j-th draft was accepted.",
            "",
        ]
    accs = t.get("val_acc") or []
    lines += [
        "## Training",
        "",
        f"- data: {t['train_tokens']:,} training tokens of the target's own continuations "
        f"({t['gen_prompts']} prompts from {t['prompt_source']}; half greedy, half sampled at "
        f"T={t['gen_temperature']}), {t['val_tokens']:,} validation tokens",
        f"- training-time test: unrolled {t['ttt_steps']} steps on the head's own outputs; soft cross-entropy "
        "against the target's distribution",
        f"- {t['steps']} steps, {t['tokens']:,} window tokens, {t['minutes']:.1f} min; "
        f"{info['params']:,} head parameters",
    ]
    if accs:
        lines.append("- validation top-1 agreement with the target per draft position: "
                     + " / ".join(f"{a:.0%}" for a in accs))
    lines += ["", "Reproduce:", "", "```bash", info["command"], "```", ""]
    (out_dir / "README.md").write_text("\n".join(lines))
