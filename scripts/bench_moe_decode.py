"""Where a decode step of the Qwen3-30B-A3B expert shape goes (issue 61), in one run: the routed experts through the
module path (a Python call per hit expert: models/moe.py expert_outputs) against one C++ call per layer
(csrc/fused_decoder.cpp MoeExperts), and the whole step in the fused C++ decoder (models/fused.py: the sparse
blocks through MoeExperts.block), rounds interleaved, all against the active-bytes roofline.

A checkpoint of `--layers` layers of the real expert shape (hidden 2048, 128 experts of width 768, top 8; 32 query
heads, 4 KV heads of 128), random bf16 weights (scripts/bench_moe_load.py writes it), in bf16, int8 and int4, at
one stream and at 16 sequences, on the threads torch has (two on this machine). Two measurements per setting:
  layer   one sparse block (router + experts) on random hidden states of n rows, per layer, best of the rounds:
          module vs C++ experts op vs the whole block in C++ (router included: what the fused step runs); the gap
          is the Python dispatch the C++ op removed; `roof` is the bytes of the experts hit divided by the read
          bandwidth measured here (study/bandwidth.py);
  step    a greedy decode step through the engine (prompts of 16 tokens; the time of `--steps` more tokens minus a
          one-token run, so prefill is out): module path, module path with the C++ experts op, the fused step;
          `roof` counts the bytes a step reads: the experts its tokens hit (recorded from the router), attention,
          router, norms and the head (the KV cache's few KB left out).

    python scripts/bench_moe_decode.py [--layers 3] [--steps 16] [--rounds 3] [--out /tmp/moe-decode]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def linear_bytes(lin, rows: int) -> int:
    if lin.quant_method is None:
        return sum(p.numel() * p.element_size() for p in lin.parameters())
    return lin.quant_method.bytes_read(lin, rows)


def expert_bytes(expert, rows: int) -> int:
    return linear_bytes(expert.gate_up_proj, rows) + linear_bytes(expert.down_proj, rows)


def fixed_bytes(model, rows: int) -> int:
    """What a step reads besides the routed experts: attention, norms, routers, the head, the rows of the embedding."""
    from leverlab.layers.linear import Linear
    from leverlab.models.moe import SparseMoE

    experts = {id(m) for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)
               for e in layer.mlp.experts for m in e.modules()}
    total = rows * model.model.embed_tokens.weight[0].numel() * model.model.embed_tokens.weight.element_size()
    for m in model.modules():
        if id(m) in experts or m is model.model.embed_tokens:
            continue
        if isinstance(m, Linear):
            total += linear_bytes(m, rows)
        elif not list(m.children()):
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


MODES = ("module", "C++ experts", "fused")  # module path; module path + MoeExperts.forward; the fused C++ step


def switch(runner, moes, kernels, fused_step, mode: str) -> None:
    on = mode != "module"
    for moe, (op, rows) in zip(moes, kernels):
        moe.kernel, moe.kernel_rows = (op, rows) if on else (None, 0)
    if runner is not None:
        runner.fused = fused_step if mode == "fused" else None


def layer_times(moes, kernels, n: int, rounds: int, bw: float) -> str:
    """Per layer: one sparse block's ms through each path (best of the rounds, interleaved) and its experts' roof."""
    g = torch.Generator().manual_seed(n)
    h = moes[0].gate.weight.shape[1]
    xs = [torch.randn(n, h, generator=g).to(torch.bfloat16) for _ in moes]
    best = dict.fromkeys(MODES, float("inf"))
    hit_bytes = 0
    with torch.inference_mode():
        for moe, x in zip(moes, xs):
            hit = moe.gate(x)[1].unique().tolist()
            hit_bytes += sum(expert_bytes(moe.experts[e], n) for e in hit)
        for _ in range(rounds):
            for mode in MODES:
                switch(None, moes, kernels, None, mode)
                run = (lambda m, x: m.kernel.block(x)) if mode == "fused" else (lambda m, x: m(x))
                for moe, x in zip(moes, xs):
                    run(moe, x)  # warm
                t0 = time.perf_counter()
                for moe, x in zip(moes, xs):
                    run(moe, x)
                best[mode] = min(best[mode], (time.perf_counter() - t0) / len(moes))
    switch(None, moes, kernels, None, "C++ experts")
    roof = hit_bytes / len(moes) / bw / 1e9
    module, cpp, block = best["module"], best["C++ experts"], best["fused"]
    return (f"layer x{n:<2d} module {1e3 * module:6.2f} ms  C++ experts {1e3 * cpp:6.2f} ms  C++ block {1e3 * block:6.2f}"
            f" ms  roof {1e3 * roof:6.2f} ms: module {100 * roof / module:4.1f}%, C++ experts {100 * roof / cpp:4.1f}%,"
            f" C++ block {100 * roof / block:4.1f}% of it")


def step_times(llm, moes, kernels, n: int, steps: int, rounds: int, bw: float) -> str:
    """Greedy decode through the engine: ms per step (the time of `steps` more tokens than a one-token run)."""
    from leverlab import SamplingParams

    runner = llm.engine.runner
    fused_step = runner.fused
    model = runner.model
    hits: list[int] = []  # per decode call of a router: the experts it hit
    rows_of = {id(m.gate): m for m in moes}

    def hook(gate, inp, out):
        if inp[0].shape[0] <= n:
            hits.append(sum(expert_bytes(rows_of[id(gate)].experts[e], n) for e in out[1].unique().tolist()))

    handles = [m.gate.register_forward_hook(hook) for m in moes]
    prompts = [list(range(5 + i, 21 + i)) for i in range(n)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    more = SamplingParams(temperature=0, max_tokens=1 + steps, ignore_eos=True)
    modes = MODES if fused_step is not None else MODES[:2]
    best = dict.fromkeys(modes, float("inf"))
    llm.generate(prompts, more)  # warm
    hit_steps = []  # per round: the experts' bytes its decode steps hit (the router runs in C++ in the fused step)
    for _ in range(rounds):
        for mode in modes:
            switch(runner, moes, kernels, fused_step, mode)
            t0 = time.perf_counter()
            llm.generate(prompts, one)
            t1 = time.perf_counter()
            hits.clear()
            llm.generate(prompts, more)
            t2 = time.perf_counter()
            best[mode] = min(best[mode], ((t2 - t1) - (t1 - t0)) / steps)
            if hits:
                hit_steps.append(sum(hits) / steps)
    for hd in handles:
        hd.remove()
    switch(runner, moes, kernels, fused_step, "fused")
    step_bytes = hit_steps[-1] + fixed_bytes(model, n)  # the last round's decode steps through the modules
    roof = step_bytes / bw / 1e9
    module = best["module"]
    out = (f"step  x{n:<2d} roof {1e3 * roof:6.2f} ms ({step_bytes / 1e6:.0f} MB)  module {1e3 * module:6.2f} ms "
           f"({n / module:6.1f} tok/s, {100 * roof / module:4.1f}%)")
    for mode in modes[1:]:
        t = best[mode]
        out += f"  {mode} {1e3 * t:6.2f} ms ({n / t:6.1f} tok/s, {100 * roof / t:4.1f}%, {module / t:4.2f}x)"
    return out


def main() -> int:
    from bench_moe_load import write_checkpoint

    from leverlab import LLM
    from leverlab.kernels import cpu_kernels
    from leverlab.models.moe import SparseMoE
    from leverlab.study.bandwidth import measure_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/moe-decode")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quant", default="bf16,int8,int4")
    a = p.parse_args()
    path = Path(a.out) / f"shape{a.layers}"
    if not (path / "config.json").exists():
        write_checkpoint(path, a.layers, 128, hidden=2048, inter=768, top_k=8, heads=32, kv_heads=4, head_dim=128)
    bw = measure_bandwidth()
    print(f"{a.layers} layers of the Qwen3-30B-A3B expert shape; threads {torch.get_num_threads()}; "
          f"read bandwidth {bw:.1f} GB/s", flush=True)
    for quant in a.quant.split(","):
        llm = LLM(str(path), dtype="bfloat16", quantization=None if quant == "bf16" else quant)
        moes = [layer.mlp for layer in llm.engine.runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]
        kernels = [(m.kernel, m.kernel_rows) for m in moes]
        if kernels[0][0] is None:
            print(f"{quant}: no C++ MoE op here (fused_moe logged why)")
            return 1
        fused_step = llm.engine.runner.fused
        kern = cpu_kernels.kernels()
        prefetch = ", ".join(f"{f} {kern.stream_prefetch(f)}" for f in ("bf16", "int8", "int4"))
        print(f"{quant} (C++ op up to {kernels[0][1]} tokens; fused step "
              f"{'up to ' + str(fused_step.max_tokens) + ' tokens' if fused_step else 'off: fused_decoder logged why'};"
              f" weight prefetch chosen at load: {prefetch})", flush=True)
        for n in (1, 16):
            print("  " + layer_times(moes, kernels, n, a.rounds, bw), flush=True)
            print("  " + step_times(llm, moes, kernels, n, a.steps, a.rounds, bw), flush=True)
        del llm, moes, kernels
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
