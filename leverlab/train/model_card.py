"""Stage `card`: evaluate the exported models and write README.md model cards (and models/README.md)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from leverlab.train.corpus import python_version
from leverlab.train.evaluate import EVAL_WINDOWS, evaluate_all
from leverlab.train.model_configs import DRAFT_NAME, TARGET_NAME, draft_config, target_config
from leverlab.train.paths import Paths
from leverlab.train.plot import read_log

RESUME_TARGET = (
    "leverlab train-default --stage target --time-budget-min {target_total} --batch-size 4 --background"
)
RESUME_DRAFT = "leverlab train-default --stage draft --draft-budget-min {draft_total} --background"


def run_summary(run_dir: Path) -> dict:
    recs = read_log(run_dir)
    train = [r for r in recs if r.get("event") == "train"]
    val = [r for r in recs if r.get("event") == "val"]
    starts = [r for r in recs if r.get("event") == "start"]
    last = (val or train or [{}])[-1]
    rates = [r["tok_per_s"] for r in train[3:]] or [0.0]
    return {
        "steps": last.get("step", 0),
        "tokens": last.get("tokens", 0),
        "train_minutes": last.get("elapsed_s", 0.0) / 60,
        "tok_per_s_median": statistics.median(rates),
        "tok_per_s_p90": statistics.quantiles(rates, n=10)[-1] if len(rates) > 1 else rates[0],
        "last_train_loss": train[-1]["loss"] if train else None,
        "last_val_loss": val[-1]["val_loss"] if val else None,
        "settings": starts[-1]["settings"] if starts else {},
        "device": starts[-1]["device"] if starts else "?",
        "sessions": len(starts),
        "val_curve": [(r["tokens"], r["val_loss"]) for r in val],
    }


def _params(cfg) -> int:
    emb = cfg.vocab_size * cfg.hidden_size
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = cfg.hidden_size * d * (2 * h + 2 * kv) + 2 * d  # q, o, k, v projections + q/k norms
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return emb + cfg.num_hidden_layers * (attn + mlp + 2 * cfg.hidden_size) + cfg.hidden_size


def _arch_table(cfg) -> str:
    return "\n".join(
        [
            "| field | value |",
            "|---|---|",
            f"| parameters | {_params(cfg):,} (tied input/output embedding counted once) |",
            f"| layers | {cfg.num_hidden_layers} |",
            f"| hidden size | {cfg.hidden_size} |",
            f"| attention heads / KV heads / head dim | {cfg.num_attention_heads} / {cfg.num_key_value_heads} / {cfg.head_dim} |",
            f"| MLP intermediate size | {cfg.intermediate_size} |",
            f"| vocabulary | {cfg.vocab_size} |",
            f"| max positions | {cfg.max_position_embeddings} (RoPE theta {(cfg.rope_parameters or {}).get('rope_theta', '?')}) |",
            "| weights | bfloat16 safetensors (trained with fp32 master weights and bf16 autocast) |",
        ]
    )


def _training_table(s: dict, data: dict) -> str:
    st = s["settings"]
    epochs = s["tokens"] / max(1, data["train"]["tokens"])
    return "\n".join(
        [
            "| field | value |",
            "|---|---|",
            f"| tokens seen | {s['tokens']:,} ({epochs:.2f} passes over the train stream) |",
            f"| optimizer steps | {s['steps']:,} (latest session: {st.get('batch_size')} x {st.get('seq_len')} tokens per step) |",
            f"| training time | {s['train_minutes']:.1f} min wall-clock (validation and checkpoints included) on `{s['device']}` "
            f"(latest session: {st.get('threads')} thread(s)), {s['sessions']} session(s) |",
            f"| throughput | {s['tokens'] / max(1.0, s['train_minutes'] * 60):,.0f} tokens/s on average; {s['tok_per_s_p90']:,.0f} tokens/s "
            f"(90th percentile of logged windows) when the shared 2-core machine was quiet: other engineers' tests "
            f"and benchmarks ran alongside, and paused the run at times |",
            f"| schedule | AdamW (0.9, 0.95), peak lr {st.get('lr')}, {st.get('warmup_steps')} warm-up steps, cosine over "
            f"the time budget ({st.get('time_budget_min')} min) to {st.get('min_lr_ratio')} x peak, wd {st.get('weight_decay')}, clip {st.get('grad_clip')} |",
        ]
    )


def _data_section(data: dict) -> str:
    return f"""## Data

The `.py` files of the CPython {data.get("python", python_version())} standard library of the interpreter that ran
the training (found with `sysconfig`, `site-packages` excluded), deduplicated by content and split **by file** with
seed 0: {len(data["split_files"]["train"])} train, {len(data["split_files"]["val"])} validation and
{len(data["split_files"]["heldout"])} held-out files. The held-out files were never trained on; the benchmark prompt
set (`models/workload.json`) and the header-continuation check below come from them only.

The train stream is {data["train"]["tokens"]:,} tokens: each train file followed by `<|endoftext|>`, plus
{data["train"]["docs"] - data["train"]["files"]:,} synthesized ChatML exchanges (about 6% of the tokens), made from
train-split functions that have a docstring: *"Write a function named X with signature `def X(...)`. <docstring
summary>"* answered with the function's source, and *"Explain this function: <source without docstring>"* answered
with its docstring. That is all the chat data there is: expect chat answers to be docstring-like at best.
The validation stream is {data["val"]["tokens"]:,} tokens from the validation files (no chat).

Tokenizer: byte-level BPE (`tokenizers`), 8,192 entries, trained on the train split only. Special tokens:
`<|endoftext|>` (id 0; end of file, eos and pad), `<|im_start|>` (1), `<|im_end|>` (2). `tokenizer_config.json`
carries a ChatML chat template (`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`, with
`add_generation_prompt`). `generation_config.json` stops on `<|endoftext|>` and `<|im_end|>` and decodes greedily.
"""


def _fence(text: str) -> str:
    return "```python\n" + text.rstrip("\n") + "\n```"


def _samples_section(ev: dict, n: int = 6) -> str:
    picks = [s for s in ev["header_samples"] if s["valid_python"]][: n - 2] + [
        s for s in ev["header_samples"] if not s["valid_python"]
    ][:2]
    parts = []
    for s in picks:
        mark = "tokenizes" if s["valid_python"] else "does NOT tokenize"
        parts.append(f"`{s['source']}` ({mark}):\n\n{_fence(s['prompt'] + s['continuation'])}\n")
    for c in ev.get("chat_samples", []):
        parts.append(
            f"Chat ({c['kind']}), request:\n\n````\n{c['request']}\n````\n\nresponse:\n\n````\n{c['response']}\n````\n"
        )
    return "\n".join(parts)


def _reproduce_section(target_min: float = 0.0, draft_min: float = 0.0) -> str:
    resume_target = RESUME_TARGET.format(target_total=round(target_min + 120))
    resume_draft = RESUME_DRAFT.format(draft_total=round(draft_min + 30))
    return f"""## Reproduce / resume

```bash
source scripts/venv.sh
leverlab train-default --stage all            # tokenizer, target, draft, export, workload, card (about 2.5 h on 2 cores)
leverlab train-default --stage target --background   # any stage can run detached; log: .cache/train/target.log
```
State lives in `.cache/train/` (gitignored): `tokenizer/`, `data/` (token arrays), `target/` and `draft/` (each
with `ckpt.pt` written every 5 minutes and `log.jsonl`). Stages resume from `ckpt.pt` by default
(`--no-resume` starts over). `--time-budget-min` is the *total* training time of the target across sessions, so
continuing a finished run means a larger budget, then re-export and re-evaluate:

```bash
{resume_target}   # {target_min:.1f} min done so far: +2 h
{resume_draft}   # {draft_min:.1f} min done so far: +30 min
leverlab train-default --stage export && leverlab train-default --stage card
```
(The learning-rate cosine follows elapsed / budget, so a larger budget raises the rate again from where the old
schedule ended: a warm restart.) On a machine with CUDA, `--device auto` trains there; `--threads` sets CPU threads.
`--stage tokenizer` keeps an existing tokenizer; with `--no-resume` it retrains it, which invalidates both
models and the workload file. The checkpoints (`ckpt.pt`, with optimizer state) are not in git: resuming needs the
`.cache/train/` of the machine that trained; without it, `--stage all` retrains from scratch.
"""


def write_cards(paths: Paths) -> dict:
    data = json.loads((paths.data / "summary.json").read_text())
    workload = json.loads(paths.workload.read_text()) if paths.workload.exists() else None
    t0 = time.monotonic()
    ev = evaluate_all(paths, workload)
    ev["eval_seconds"] = time.monotonic() - t0
    (paths.work / "eval.json").write_text(json.dumps(ev, indent=1) + "\n")
    ts, ds = run_summary(paths.target_run), run_summary(paths.draft_run)
    has_draft = "draft_val_loss" in ev
    val_line = f"| validation loss / perplexity (target) | {ev['target_val_loss']:.4f} nats / {ev['target_val_ppl']:.2f} |"
    valid = (
        f"{ev['valid_python_share']:.0%} of {len(ev['header_samples'])} greedy continuations "
        f"({ev['valid_python_share_full64']:.0%} of the {ev['num_full64']} that ran the full 64 tokens)"
    )
    results = [
        "| measure | value |",
        "|---|---|",
        val_line,
        f"| header continuations that tokenize as Python | {valid} |",
    ]
    if has_draft:
        results += [
            f"| validation loss / perplexity (draft) | {ev['draft_val_loss']:.4f} nats / {ev['draft_val_ppl']:.2f} |",
            f"| draft top-1 agreement with the target (validation positions) | {ev['draft_top1_agreement']:.1%} |",
            f"| draft agreement along the target's greedy continuations | {ev['draft_agree_on_target_greedy']:.1%} |",
        ]
    results_md = "\n".join(results)
    eval_note = (
        f"Validation figures: {ev['val_tokens']:,} next-token predictions from {EVAL_WINDOWS} evenly spaced "
        f"513-token windows of the validation split, computed in fp32 from the shipped bf16 weights. "
        f'"Tokenizes as Python": prompt (a held-out function\'s `def` header) + greedy continuation of up to 64 '
        f"tokens, cut back to its last complete line, read by `tokenize.generate_tokens` without an error "
        f"(unterminated strings, brackets left open at the cut, and inconsistent dedents all count as failures). "
        f"Prompts end at the colon, not at a newline: the byte-level pre-tokenizer merges a newline with the next "
        f"line's indentation, so a prompt that ends in a bare newline before indented code is a token boundary the "
        f"model never saw (its continuations degrade); the same holds for any code prompt."
    )
    target_md = f"""# {TARGET_NAME}

LeverLab's bundled default model: a ~15.7M-parameter Qwen3 decoder trained from scratch on the Python standard
library's own source, so the lab runs offline with a real (if small) code model. It loads in LeverLab (the default
when no model is given) and in `transformers` (`AutoModelForCausalLM.from_pretrained("models/{TARGET_NAME}")`).
Its speculative-decoding partner is `models/{DRAFT_NAME}` (same tokenizer).

![training curve](training-curve.png)

## Results

{results_md}

{eval_note}

## Architecture

{_arch_table(target_config())}

## Training

{_training_table(ts, data)}

Loss: next-token cross-entropy over random 513-token windows of the train stream (windows may span file
boundaries at `<|endoftext|>`). Validation during training used 48 fixed windows (the curve's dots).

{_data_section(data)}
## Samples (greedy, held-out function headers; up to 64 new tokens; the prompt is the `def` line)

{_samples_section(ev)}
{_reproduce_section(ts["train_minutes"], ds["train_minutes"])}
## Limitations

A model of this size writes plausible-looking Python with wrong logic; it knows nothing beyond the stdlib's
code and docstrings. It exists to exercise an inference engine and benchmark, not to be useful as an assistant.
"""
    paths.target_out.joinpath("README.md").write_text(target_md)
    if has_draft:
        draft_md = f"""# {DRAFT_NAME}

The draft model for speculative decoding with `models/{TARGET_NAME}`: a ~1.4M-parameter Qwen3 (about a tenth of
the target) with the same tokenizer, trained by distillation from the target's output distribution.

![training curve](training-curve.png)

## Results

{results_md}

{eval_note}
"Top-1 agreement" is the share of positions where the draft's argmax token equals the target's argmax token:
the acceptance rate a greedy speculative decoder can expect per proposed token.

## Architecture

{_arch_table(draft_config())}

## Training

{_training_table(ds, data)}

Loss: 0.9 x KL(target || draft) at temperature {1.0} (x T^2) + 0.1 x cross-entropy on the data, over the same
train stream as the target; the target ran in bf16 autocast as the teacher. Temperature 1: the draft's only job is
to agree with the target's top choice, and a softer target would spend its small capacity on the tail.

{_data_section(data)}
{_reproduce_section(ts["train_minutes"], ds["train_minutes"])}"""
        paths.draft_out.joinpath("README.md").write_text(draft_md)
    write_models_readme(paths, ev)
    print(json.dumps({k: v for k, v in ev.items() if not isinstance(v, list)}, indent=1), flush=True)
    return ev


def write_models_readme(paths: Paths, ev: dict) -> None:
    eagle = ""
    if (paths.models / "leverlab-code-eagle" / "config.json").exists():  # made by `leverlab train-eagle`
        eagle = ("| `leverlab-code-eagle/` | EAGLE speculative head for the default model (one layer, ~2.3M "
                 "parameters), made by `leverlab train-eagle` (docs/speculative.md) |\n")
    text = f"""# Bundled models and prompt set

Made by `leverlab train-default` (code in `leverlab/train/`) from the standard library source of the training
interpreter; nothing downloaded.

| path | what |
|---|---|
| `{TARGET_NAME}/` | default model: Qwen3, ~15.7M parameters, bf16; val perplexity {ev["target_val_ppl"]:.2f} |
| `{DRAFT_NAME}/` | speculative draft: Qwen3, ~1.4M parameters, distilled from the target |
{eagle}| `workload.json` | benchmark prompt set from held-out files: buckets short (64 tokens in / 256 out), medium (512/256), long (1500/256), decode (64/1024), and ChatML chat requests |

See each folder's README.md for data, training, figures, and how to reproduce or resume.
"""
    (paths.models / "README.md").write_text(text)
