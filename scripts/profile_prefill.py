"""Where a cold prefill's time goes, per phase of the fused step, and what the AMX int8 GEMM alone reaches.

Phases: one cold prompt of --prompt-len random token ids at a time (prefix caching off, a new prompt each round),
through LLM.generate for one token; the fused step's C++ phase timers (FusedDecoder.set_phase_timing: norms, qkv,
rope, attention, o, gate_up, act, down, head) of the fastest round. The prefill must take the fused path (a model
the fused decoder runs, with AVX2 or better); elsewhere the script says so and stops.

--gemms: the model's four layer GEMMs (qkv, o, gate_up, down, its own shapes) at --prompt-len rows on the AMX int8
kernel alone (amx_int8_linear), each over as many distinct random weights as the model has layers so that they
come from memory as in a prefill, in G multiply-adds a second. Needs AMX int8 (Sapphire Rapids or later).

Rates on a shared machine drift between runs: compare figures from one run, or runs alternated seconds apart.

    python scripts/profile_prefill.py [--model DIR] [--quantization int8] [--prompt-len 1024] [--rounds 3]
                                      [--threads 1] [--gemms]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def phases(args: argparse.Namespace) -> None:
    from leverlab import LLM, SamplingParams

    kw = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(args.model, dtype="bfloat16", num_threads=args.threads, enable_prefix_caching=False, **kw)
    fused = llm.engine.runner.fused
    if fused is None:
        sys.exit("this model or CPU does not take the fused step: no phase timers")
    fused.dec.set_phase_timing(True)
    vocab = llm.engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    best = None
    for r in range(args.rounds):
        ids = [rng.randrange(100, min(vocab, 10000)) for _ in range(args.prompt_len)]
        fused.dec.phase_times()  # reset
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        ph = {k: v for k, v in fused.dec.phase_times() if k != "steps"}
        print(f"round {r}: {dt * 1e3:.0f} ms", flush=True)
        if best is None or dt < best[0]:
            best = (dt, ph)
    dt, ph = best
    print(f"best {dt * 1e3:.0f} ms: " + " ".join(f"{k}={v * 1e3:.0f}" for k, v in ph.items()) + " (ms)")
    llm.close()


def gemms(args: argparse.Namespace) -> None:
    import torch

    from leverlab.models.config import ModelConfig
    from leverlab.quant import int8_gemm

    kern = int8_gemm.amx_kernels()
    if kern is None:
        sys.exit("no AMX int8 on this CPU or build: the int8 GEMM here is fbgemm's")
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_folder(args.model)
    hid, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, hid), "o": (hid, cfg.num_heads * hd),
              "gate_up": (2 * inter, hid), "down": (hid, inter)}
    M, L = args.prompt_len, cfg.num_layers
    ws = {name: [int8_gemm.pack_amx(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01)
                 for _ in range(L)] for name, (n, k) in shapes.items()}
    xs = {k: torch.randn(M, k, dtype=torch.bfloat16) for _, k in shapes.values()}
    for r in range(args.rounds):
        row = []
        for name, (n, k) in shapes.items():
            t = time.perf_counter()
            for w in ws[name]:
                kern.amx_int8_linear(xs[k], w.packed, w.scales)
            dt = time.perf_counter() - t
            row.append(f"{name} {dt * 1e3:.0f} ms ({M * n * k * L / dt / 1e9:.0f} G/s)")
        print(f"round {r}: " + " | ".join(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / ".cache" / "qwen3-0.6b-shape"))
    ap.add_argument("--quantization", default=None, help="e.g. int8 (default: the model's bf16)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemms", action="store_true", help="the AMX int8 GEMM alone instead of the phases")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        sys.exit(f"no model folder at {args.model} (python scripts/make_qwen3_06b_shape.py writes the 0.6B shape)")
    gemms(args) if args.gemms else phases(args)


if __name__ == "__main__":
    main()
