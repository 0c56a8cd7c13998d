"""Where a decode step's time goes, per phase, with and without the fused decode path (one run, same machine).

One request (a --prompt-len-token prompt, then --decode-len greedy tokens) at a time through LLM.generate; every decode
step is cut into phases by timing the engine's own calls:
  schedule   Scheduler.schedule (admission, KV blocks)
  inputs     ModelRunner.execute minus the forward and the head: the step's tensors from the batch
  forward    the decoder (fused: one C++ call that also computes the head's logits and their argmax;
             modules: the layer-by-layer path)
  head       the output head's logits for the sampled rows, where the step computes them apart (modules)
  rest       sampling, detokenizing, stop checks, outputs: the step minus everything above
The prefill step is left out. Best of --rounds (the lowest total); the paths alternate within each round.

    python scripts/profile_step.py [--model DIR] [--quantization int8] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("schedule", "inputs", "forward", "head", "rest", "total")


def instrument(llm) -> dict[str, float]:
    """Wrap the engine's calls with timers; returns the per-phase accumulator (seconds, decode steps only)."""
    eng, runner = llm.engine, llm.engine.runner
    acc = dict.fromkeys(PHASES, 0.0) | {"steps": 0}
    cur: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    runner.execute = timed("execute", runner.execute)
    runner.model.compute_logits = timed("head", runner.model.compute_logits)
    if runner.fused is not None:
        class Timed:  # the fused forward, timed; its step() (decoder and head in one call) counts as forward
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def __call__(self, *a):
                return timed("forward", self.inner.__call__)(*a)

            def step(self, *a):
                return timed("forward", self.inner.step)(*a)

        runner.fused = Timed(runner.fused)
    else:
        runner.forward = timed("forward", runner.forward)
    step = eng.step

    def step_timed(**kw):
        cur.clear()
        decode = all(s.num_computed_tokens == s.num_tokens - 1 for s in eng.scheduler.running) and \
            bool(eng.scheduler.running) and not eng.scheduler.waiting
        t0 = time.perf_counter()
        out = step(**kw)
        total = time.perf_counter() - t0
        if decode:
            acc["schedule"] += cur.get("schedule", 0.0)
            acc["forward"] += cur.get("forward", 0.0)
            acc["head"] += cur.get("head", 0.0)
            acc["inputs"] += cur.get("execute", 0.0) - cur.get("forward", 0.0) - cur.get("head", 0.0)
            acc["rest"] += total - cur.get("execute", 0.0) - cur.get("schedule", 0.0)
            acc["total"] += total
            acc["steps"] += 1
        return out

    eng.step = step_timed
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128, help="context before decoding (the study's medium bucket: 512)")
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execution-mode", default="eager", choices=("eager", "compiled"))
    args = ap.parse_args()

    from leverlab import LLM, SamplingParams

    def build(fused: bool):
        os.environ["LEVERLAB_NO_FUSED_DECODE"] = "0" if fused else "1"
        llm = LLM(args.model or None, quantization=args.quantization, num_threads=args.threads,
                  execution_mode=args.execution_mode)
        return llm, instrument(llm)

    paths = {"fused": build(True), "modules": build(False)}
    prompt = [5 + i % 4000 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_len, ignore_eos=True)
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, (llm, acc) in paths.items():
            for k in acc:
                acc[k] = 0
            llm.generate([prompt], params)
            per_step = {k: acc[k] / acc["steps"] * 1e3 for k in PHASES}
            if r > 0 and (name not in best or per_step["total"] < best[name]["total"]):
                best[name] = per_step
    print(f"decode step, ms (best of {args.rounds}; {args.prompt_len}-token prompt; {args.threads} thread(s); "
          f"{args.quantization or 'bf16'}; {args.execution_mode})")
    print("| path | " + " | ".join(PHASES) + " | tok/s |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for name, ph in best.items():
        print(f"| {name} | " + " | ".join(f"{ph[k]:.3f}" for k in PHASES) + f" | {1e3 / ph['total']:.0f} |")
    ratio = best["modules"]["total"] / best["fused"]["total"]
    print(f"fused / modules: {ratio:.2f}x faster per decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
