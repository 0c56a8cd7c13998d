"""`leverlab generate`: run prompts through the engine and print the completions with their timings."""

from __future__ import annotations

import argparse
import sys
import time

from leverlab.chat import render_chat
from leverlab.engine_args import add_engine_arguments, config_from_args
from leverlab.errors import LeverLabError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompts (default: read one from stdin)")
    p.add_argument("--model", default="", help="Hugging Face model folder, Hub id or GGUF file (default: the bundled model)")
    add_engine_arguments(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--sampling-seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[])
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")


def run(args: argparse.Namespace) -> int:
    from leverlab.llm import LLM
    from leverlab.sampling_params import SamplingParams

    prompts = args.prompts or [sys.stdin.read()]
    try:
        cfg = config_from_args(args, args.model).resolve_models()
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        t0 = time.monotonic()
        llm = LLM(**vars(cfg))
        load_s = time.monotonic() - t0
        if args.chat:
            # the renderer of the server and LLM.chat, so --chat prompts are the ones those build
            prompts = [render_chat(llm.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        t0 = time.monotonic()
        outs = llm.generate(prompts, params)
        wall = time.monotonic() - t0
    except (LeverLabError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outs:
        o, m = out.outputs[0], out.metrics
        print(f"--- {out.request_id}: {len(out.prompt_token_ids)} prompt tokens -> {len(o.token_ids)} tokens "
              f"({o.finish_reason}); TTFT {1e3 * (m.ttft or 0):.0f} ms, decode {1e3 * m.decode_s:.0f} ms")
        print((out.prompt or "") + o.text)
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"--- load {load_s:.1f} s; {total} tokens in {wall:.2f} s ({total / wall:.1f} tok/s)", file=sys.stderr)
    return 0
