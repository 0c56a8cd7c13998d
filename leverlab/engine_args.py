"""Engine flags shared by `leverlab serve`, `leverlab generate` and the benchmarks, named as vLLM names them."""

from __future__ import annotations

import argparse
import json

from leverlab.config import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser, model_positional: bool = True) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default="", help="Hugging Face model folder (default: the bundled model)")
    else:
        p.add_argument("--model", default="", help="Hugging Face model folder (default: the bundled model)")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    g.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting,
                   help="waiting requests before new ones get 503")
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV cache size as a share of the memory free after loading the weights")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_prefix_caching)
    g.add_argument("--quantization", "-q", default=None)
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--speculative-config", type=json.loads, default=None, help="JSON, as vLLM takes it")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--execution-mode", choices=["compiled", "eager"], default=None,
                   help="compiled (default; torch.compile, cached) or eager")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    kw = dict(
        model=args.model or "",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=args.enable_prefix_caching,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        num_threads=args.num_threads,
        seed=args.seed,
    )
    if args.execution_mode:
        kw["execution_mode"] = args.execution_mode
    return EngineConfig(**kw)
