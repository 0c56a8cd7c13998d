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

Inside the fused step (its C++ phase timers, FusedDecoder.set_phase_timing): norms, qkv, rope, attention, o,
gate_up, act, down, head, per decode step of the best round, and for each linear phase the bytes of weights it reads
a step, its read rate, and that rate's share of the machine's read bandwidth measured in the same run
(study/bandwidth.py).

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


def instrument_inside(llm) -> dict[str, float] | None:
    """The fused step's own phase timers, summed over decode steps only (None without the fused path)."""
    eng, fused = llm.engine, llm.engine.runner.fused
    if fused is None:
        return None
    fused.dec.set_phase_timing(True)
    inside: dict[str, float] = {}
    step = eng.step

    def step_timed(**kw):
        decode = all(s.num_computed_tokens == s.num_tokens - 1 for s in eng.scheduler.running) and \
            bool(eng.scheduler.running) and not eng.scheduler.waiting
        fused.dec.phase_times()  # drops whatever a non-decode step timed
        out = step(**kw)
        if decode:
            for name, v in fused.dec.phase_times():
                inside[name] = inside.get(name, 0.0) + v
        return out

    eng.step = step_timed
    return inside


def print_inside(inside: dict[str, float], nbytes: dict[str, float], step_ms: float, bandwidth: float) -> None:
    n = inside["steps"]
    print(f"\ninside the fused step, per decode step (the best round; read bandwidth measured here: {bandwidth:.1f} GB/s)")
    print("| phase | ms | share of the step | MB read | GB/s | share of the read bandwidth |")
    print("|---|---|---|---|---|---|")
    timed = 0.0
    for name, total in inside.items():
        if name == "steps":
            continue
        ms = total / n * 1e3
        timed += ms
        row = f"| {name} | {ms:.3f} | {ms / step_ms:.0%} |"
        if name in nbytes:
            gbs = nbytes[name] / (ms * 1e-3) / 1e9
            row += f" {nbytes[name] / 1e6:.1f} | {gbs:.1f} | {gbs / bandwidth:.0%} |"
        else:
            row += " | | |"
        print(row)
    print(f"| outside (engine: schedule, inputs, sampling, outputs) | {step_ms - timed:.3f} | "
          f"{(step_ms - timed) / step_ms:.0%} | | | |")


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
    inside = instrument_inside(paths["fused"][0])
    best_inside: dict[str, float] = {}
    prompt = [5 + i % 4000 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_len, ignore_eos=True)
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, (llm, acc) in paths.items():
            for k in acc:
                acc[k] = 0
            if name == "fused" and inside is not None:
                inside.clear()
            llm.generate([prompt], params)
            per_step = {k: acc[k] / acc["steps"] * 1e3 for k in PHASES}
            if r > 0 and (name not in best or per_step["total"] < best[name]["total"]):
                best[name] = per_step
                if name == "fused" and inside:
                    best_inside = dict(inside)
    print(f"decode step, ms (best of {args.rounds}; {args.prompt_len}-token prompt; {args.threads} thread(s); "
          f"{args.quantization or 'bf16'}; {args.execution_mode})")
    print("| path | " + " | ".join(PHASES) + " | tok/s |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for name, ph in best.items():
        print(f"| {name} | " + " | ".join(f"{ph[k]:.3f}" for k in PHASES) + f" | {1e3 / ph['total']:.0f} |")
    ratio = best["modules"]["total"] / best["fused"]["total"]
    print(f"fused / modules: {ratio:.2f}x faster per decode step")
    if best_inside.get("steps"):
        from leverlab.study.bandwidth import measure_bandwidth

        nbytes = dict(paths["fused"][0].engine.runner.fused.dec.phase_bytes())
        print_inside(best_inside, nbytes, best["fused"]["total"], measure_bandwidth(args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
