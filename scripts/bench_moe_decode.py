"""Where a decode step of the Qwen3-30B-A3B expert shape goes (issue 61), in one run: the routed experts through the
module path (a Python call per hit expert: models/moe.py expert_outputs) against one C++ call per layer
(csrc/fused_decoder.cpp MoeExperts), rounds interleaved, and both against the active-bytes roofline.

A checkpoint of `--layers` layers of the real expert shape (hidden 2048, 128 experts of width 768, top 8; 32 query
heads, 4 KV heads of 128), random bf16 weights (scripts/bench_moe_load.py writes it), in bf16, int8 and int4, at
one stream and at 16 sequences, on the threads torch has (two on this machine). Two measurements per setting:
  layer   one sparse block (router + experts) on random hidden states of n rows, per layer, best of the rounds:
          module vs C++; the gap is the Python dispatch the C++ op removed; `roof` is the bytes of the experts hit
          divided by the read bandwidth measured here (study/bandwidth.py);
  step    a greedy decode step through the engine (prompts of 16 tokens; the time of `--steps` more tokens minus a
          one-token run, so prefill is out), module vs C++; `roof` counts the bytes a step reads: the experts its
          tokens hit (recorded from the router), attention, router, norms and the head (the KV cache's few KB
          left out).

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


def switch(moes, kernels, on: bool) -> None:
    for moe, (op, rows) in zip(moes, kernels):
        moe.kernel, moe.kernel_rows = (op, rows) if on else (None, 0)


def layer_times(moes, kernels, n: int, rounds: int, bw: float) -> str:
    """Per layer: one sparse block's ms through each path (best of the rounds, interleaved) and its experts' roof."""
    g = torch.Generator().manual_seed(n)
    h = moes[0].gate.weight.shape[1]
    xs = [torch.randn(n, h, generator=g).to(torch.bfloat16) for _ in moes]
    best = {False: float("inf"), True: float("inf")}
    hit_bytes = 0
    with torch.inference_mode():
        for moe, x in zip(moes, xs):
            hit = moe.gate(x)[1].unique().tolist()
            hit_bytes += sum(expert_bytes(moe.experts[e], n) for e in hit)
        for _ in range(rounds):
            for on in (False, True):
                switch(moes, kernels, on)
                for moe, x in zip(moes, xs):
                    moe(x)  # warm
                t0 = time.perf_counter()
                for moe, x in zip(moes, xs):
                    moe(x)
                best[on] = min(best[on], (time.perf_counter() - t0) / len(moes))
    switch(moes, kernels, True)
    roof = hit_bytes / len(moes) / bw / 1e9
    module, cpp = best[False], best[True]
    return (f"layer x{n:<2d} module {1e3 * module:6.2f} ms  C++ {1e3 * cpp:6.2f} ms  (python {100 * (module - cpp) / module:4.1f}%"
            f" of the module path)  roof {1e3 * roof:6.2f} ms: module {100 * roof / module:4.1f}%, C++ "
            f"{100 * roof / cpp:4.1f}% of it")


def step_times(llm, moes, kernels, n: int, steps: int, rounds: int, bw: float) -> str:
    """Greedy decode through the engine: ms per step (the time of `steps` more tokens than a one-token run)."""
    from leverlab import SamplingParams

    model = llm.engine.runner.model
    hits: list[int] = []  # per decode call of a router: the experts it hit
    rows_of = {id(m.gate): m for m in moes}

    def hook(gate, inp, out):
        if inp[0].shape[0] <= n:
            hits.append(sum(expert_bytes(rows_of[id(gate)].experts[e], n) for e in out[1].unique().tolist()))

    handles = [m.gate.register_forward_hook(hook) for m in moes]
    prompts = [list(range(5 + i, 21 + i)) for i in range(n)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    more = SamplingParams(temperature=0, max_tokens=1 + steps, ignore_eos=True)
    best = {False: float("inf"), True: float("inf")}
    llm.generate(prompts, more)  # warm
    for _ in range(rounds):
        for on in (False, True):
            switch(moes, kernels, on)
            t0 = time.perf_counter()
            llm.generate(prompts, one)
            t1 = time.perf_counter()
            hits.clear()
            llm.generate(prompts, more)
            t2 = time.perf_counter()
            best[on] = min(best[on], ((t2 - t1) - (t1 - t0)) / steps)
    for hd in handles:
        hd.remove()
    switch(moes, kernels, True)
    step_bytes = sum(hits) / steps + fixed_bytes(model, n)  # the last round's decode steps
    roof = step_bytes / bw / 1e9
    module, cpp = best[False], best[True]
    return (f"step  x{n:<2d} module {1e3 * module:6.2f} ms ({n / module:6.1f} tok/s)  C++ {1e3 * cpp:6.2f} ms "
            f"({n / cpp:6.1f} tok/s)  {module / cpp:4.2f}x  roof {1e3 * roof:6.2f} ms ({step_bytes / 1e6:.0f} MB): "
            f"module {100 * roof / module:4.1f}%, C++ {100 * roof / cpp:4.1f}% of it")


def main() -> int:
    from bench_moe_load import write_checkpoint

    from leverlab import LLM
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
        print(f"{quant} (C++ op up to {kernels[0][1]} tokens)", flush=True)
        for n in (1, 16):
            print("  " + layer_times(moes, kernels, n, a.rounds, bw), flush=True)
            print("  " + step_times(llm, moes, kernels, n, a.steps, a.rounds, bw), flush=True)
        del llm, moes, kernels
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
