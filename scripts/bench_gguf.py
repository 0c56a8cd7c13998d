"""GGUF benchmark (issue 60's bar): a Q4_0 GGUF of the Qwen3-0.6B shape decodes within 5% of our own int4 of the
same model, in one run. The GGUF is llama.cpp's (its converter, then llama-quantize Q4_0: peer_llamacpp's cache);
our int4 quantizes the HF folder at load, at its default groups of 64 and at Q4_0's 32. Single-stream decode,
rounds interleaved at each thread count so that a noisy spell on the shared machine hits every engine alike; the
best round counts (the least disturbed), the median is printed beside it.

    python scripts/bench_gguf.py [--model DIR] [--gguf FILE] [--threads 1,2] [--rounds 3] [--decode-len 64]

Without --gguf the Q4_0 file comes from peer_llamacpp's cache, made on first use (that needs llama.cpp built:
python -m leverlab.bench.peer_llamacpp build).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import aggregate_decode  # noqa: E402


def q4_0_gguf(model: Path) -> Path:
    from leverlab.bench import peer_llamacpp as peer

    root = peer.default_dir()
    return peer.convert(model, root, peer.ensure_built(root), ["int4"], None)["int4"]


def step_bytes(llm) -> int:
    """Bytes of the linear layers' weights one single-stream decode step reads (the head included)."""
    from leverlab.layers.linear import Linear

    return sum(m.method.bytes_read(m, 1) for m in llm.engine.runner.model.modules() if isinstance(m, Linear))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "qwen3-0.6b-shape"))
    ap.add_argument("--gguf", default=None, help="a Q4_0 GGUF of --model (default: llama.cpp's, from the peer cache)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-len", type=int, default=64)
    args = ap.parse_args()
    from make_qwen3_06b_shape import make

    from leverlab import LLM, SamplingParams

    model = make(Path(args.model))
    gguf = Path(args.gguf) if args.gguf else q4_0_gguf(model)
    engines = {  # name -> (model, --quantization)
        "gguf-q4_0": (gguf, None),
        "int4 (g64)": (model, "int4"),
        "int4-g32": (model, "int4-g32"),
    }
    llms = {}
    for name, (path, q) in engines.items():
        llms[name] = LLM(str(path), dtype=args.dtype, quantization=q, max_num_seqs=1,
                         max_model_len=args.prompt_len + args.decode_len + 16)
        print(f"{name}: {path} -> {llms[name].engine.runner.model.quant_method}, linear layers read "
              f"{step_bytes(llms[name]) / 1e6:.1f} MB per step", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.decode_len, ignore_eos=True)
    prompt = [list(range(100, 100 + args.prompt_len))]
    threads = [int(t) for t in args.threads.split(",")]
    rates: dict[tuple[int, str], list[float]] = {}
    for t in threads:
        torch.set_num_threads(t)
        for llm in llms.values():  # warm-up at this thread count
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        for rnd in range(args.rounds):
            for name, llm in llms.items():
                tok_s, _ = aggregate_decode(llm.generate(prompt, params))
                rates.setdefault((t, name), []).append(tok_s)
                print(f"  threads {t} round {rnd + 1} {name:11s}: {tok_s:6.1f} tok/s", flush=True)
    print("\n| threads | engine | decode tok/s (best) | median | x int4 (g64) | x int4-g32 |\n|---|---|---|---|---|---|")
    for t in threads:
        best = {n: max(rates[t, n]) for n in engines}
        for n in engines:
            print(f"| {t} | {n} | {best[n]:.1f} | {statistics.median(rates[t, n]):.1f} | "
                  f"{best[n] / best['int4 (g64)']:.3f} | {best[n] / best['int4-g32']:.3f} |")
    for t in threads:
        r = max(rates[t, "gguf-q4_0"]) / max(rates[t, "int4 (g64)"])
        print(f"bar, {t} thread(s): Q4_0 GGUF at {r:.3f}x our int4 (g64): {'met' if r >= 0.95 else 'NOT met'} "
              f"(within 5%)")
    for llm in llms.values():
        llm.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
