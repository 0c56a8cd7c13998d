"""Issue 60's bar for compressed-tensors: a W8A8 compressed-tensors checkpoint of the Qwen3-0.6B shape decodes within
5% of our own int8 of the same model, in one run (both reach the same int8 kernels). `--scheme w4a16` times a W4A16
checkpoint (groups of 128, symmetric, as the releases are) against our --quantization int4-g128 the same way.

The checkpoint is written once by the `compressed-tensors` package itself (tests/quant/ct_writer.py: its
apply_quantization_config and ModelCompressor, the W8A8 preset: per-channel int8 weights with scale max|w| / 127.5,
dynamic per-token activations, lm_head ignored), from the bf16 0.6B-shape checkpoint, into the cache. `--ct DIR`
takes another folder instead (e.g. `leverlab quantize --method w8a8` output, or a published release of a model
of this shape).

Both engines are loaded in this process, for each thread count in turn, and single-stream decode is timed in
rounds that alternate between them (the first of each pair swapping), so drift on this shared machine falls on
both; the median per engine counts. The head: compressed-tensors releases leave lm_head in bf16 (vLLM keeps it
so, and so does our --lm-head-quantization auto for them), while our int8 puts the tied head in int8 by default.
The bar compares like with like (`--ct-head match`, default: the head our run picked, int8 for int8, int6 or int8
for int4); `--ct-head auto` measures the checkpoint as published, its bf16 head included.

    flock /tmp/leverlab-cpu.lock python scripts/bench_ct.py [--scheme w8a8|w4a16] [--threads 1,2] [--rounds 5]
                                  [--decode-len 64] [--ct-head match|auto] [--ct DIR] [--mode eager]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

BAR = 0.95  # compressed-tensors / our int8, decode tok/s


OURS = {"w8a8": "int8", "w4a16": "int4-g128"}


def ct_folder(src: Path, scheme: str) -> Path:
    """The package-written folder of `src`, made once into the cache (keyed by the source's files)."""
    from leverlab import env
    from tests.quant.ct_writer import FORMATS, SCHEMES, write_ct

    stamp = "-".join(f"{f.stat().st_size}-{int(f.stat().st_mtime)}" for f in sorted(src.glob("*.safetensors")))
    dst = env.cache_dir() / "ct" / f"{src.name}-{scheme}-{hashlib.sha1(stamp.encode()).hexdigest()[:12]}"
    if not (dst / "config.json").is_file():
        print(f"writing a {scheme} compressed-tensors checkpoint with the package into {dst}", flush=True)
        t0 = time.perf_counter()
        spec = SCHEMES[scheme]
        if scheme == "w4a16":  # the releases' group
            spec = {"weights": {**spec["weights"], "group_size": 128}}
        write_ct(src, dst.with_suffix(".tmp"), spec, FORMATS[scheme])
        dst.with_suffix(".tmp").rename(dst)
        print(f"  written in {time.perf_counter() - t0:.0f} s", flush=True)
    return dst


def engine(path: str, threads: int, mode: str, quantization: str | None, head: str, max_len: int):
    from leverlab import LLM

    return LLM(path, dtype="bfloat16", quantization=quantization, lm_head_quantization=head, num_threads=threads,
               execution_mode=mode, max_num_seqs=1, max_model_len=max_len, enable_prefix_caching=False)


def decode_tok_s(llm, prompt: list[int], decode_len: int) -> float:
    from leverlab import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True))[0]
    times = out.metrics.token_times
    return (len(times) - 1) / max(1e-9, times[-1] - times[0])  # decode only: from the first token on


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "qwen3-0.6b-shape"))
    ap.add_argument("--scheme", default="w8a8", choices=list(OURS))
    ap.add_argument("--ct", default=None, help="a compressed-tensors folder of --scheme (default: written by the package)")
    ap.add_argument("--ct-head", default="match", choices=["match", "auto"])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    args = ap.parse_args()
    from make_qwen3_06b_shape import make

    src = Path(make(Path(args.model)))
    ct = Path(args.ct) if args.ct else ct_folder(src, args.scheme)
    ours_q = OURS[args.scheme]
    prompt = torch.randint(100, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    max_len = args.prompt_len + args.decode_len + 16
    print(f"model {src}\ncompressed-tensors {args.scheme} {ct} (head: {args.ct_head})\nmode {args.mode}, prompt "
          f"{args.prompt_len}, decode {args.decode_len}, {args.rounds} interleaved rounds", flush=True)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        ours = engine(str(src), threads, args.mode, ours_q, "auto", max_len)
        head = ours.engine.runner.model.lm_head.quant_method
        ct_head = (head.name if head is not None else "none") if args.ct_head == "match" else "auto"
        theirs = engine(str(ct), threads, args.mode, None, ct_head, max_len)
        assert theirs.engine.runner.model.quant_method.name == "compressed-tensors"
        print(f"  threads {threads}: head {ct_head} on the checkpoint, "
              f"{head.name if head is not None else 'model dtype'} on ours", flush=True)
        pair = {ours_q: ours, f"ct-{args.scheme}": theirs}
        for llm in pair.values():  # warm-up: kernels, autotune, caches
            decode_tok_s(llm, prompt, 8)
        got: dict[str, list[float]] = {k: [] for k in pair}
        for r in range(args.rounds):
            for name in (list(pair) if r % 2 == 0 else list(pair)[::-1]):
                got[name].append(decode_tok_s(pair[name], prompt, args.decode_len))
            print(f"  threads {threads} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()),
                  flush=True)
        a, b = (statistics.median(v) for v in got.values())
        rows.append((threads, a, b, b / a))
        del ours, theirs, pair
        gc.collect()
    print(f"\n| threads | our {ours_q} tok/s | compressed-tensors {args.scheme} tok/s | ratio | bar (>= 0.95) |")
    print("|---|---|---|---|---|")
    for threads, a, b, ratio in rows:
        print(f"| {threads} | {a:.1f} | {b:.1f} | {ratio:.3f} | {'pass' if ratio >= BAR else 'FAIL'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
