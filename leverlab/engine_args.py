"""Engine flags shared by `leverlab serve` and `leverlab generate`, named as vLLM names them, and the keywords
of `LLM(...)` (llm_kwargs: vLLM's constructor names mapped onto EngineConfig, the rest refused by name).

Every flag defaults to None, meaning "the EngineConfig default": defaults live in one place (config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from leverlab.config import DTYPES, EngineConfig
from leverlab.errors import UnsupportedLever


def _json_object(s: str) -> dict:
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


# flag -> EngineConfig field
ENGINE_FIELDS = (
    "revision", "tokenizer", "tokenizer_revision", "trust_remote_code", "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size",
    "num_kv_blocks", "kv_cache_memory", "kv_cache_memory_fraction", "enable_prefix_caching", "quantization",
    "kv_cache_dtype", "lm_head_quantization", "speculative_config", "structured_outputs_jump_forward",
    "tensor_parallel_size", "data_parallel_size", "nnodes", "node_rank", "master_addr", "master_port",
    "execution_mode", "num_threads", "seed",
)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine levers (named as in vLLM; unset = the engine's default)")
    g.add_argument("--revision", default=None,
                   help="with a Hugging Face Hub id as the model: its branch, tag or commit (default: main)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the model's own; a GGUF file's from its metadata)")
    g.add_argument("--tokenizer-revision", default=None, help="with a Hub id as --tokenizer: its branch, tag or commit")
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="accepted for the architectures LeverLab implements (its own code runs); no model code "
                   "from a repository is ever run, so any other architecture is refused")
    g.add_argument("--dtype", default=None, choices=("auto", "half", "float", *DTYPES),
                   help="auto (bfloat16), half (float16), float (float32), or the name")
    g.add_argument("--device", default=None, help="auto (cuda when present), cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--max-waiting", type=int, default=None, help="waiting bound, in sequences (prompts x n): past --max-num-seqs + this many running or "
                   "waiting, 503 + Retry-After; a request larger than that sum gets 400")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV cache size as a share of the memory free after loading the weights")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--quantization", "-q", default=None)
    g.add_argument("--kv-cache-dtype", default=None)
    g.add_argument("--lm-head-quantization", default=None, choices=("auto", "none", "int8", "int6", "same"),
                   help="the output head's precision: auto (int8 with --quantization int8; int6 with int4 on CPUs "
                   "with AVX-512 VNNI or AVX2, else int8; the model dtype otherwise), none (the model dtype), "
                   "int8, int6, or same (the --quantization method's own)")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--structured-outputs-jump-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="structured output: append the tokens a grammar forces without a decode pass each "
                   "(default on; lossless)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks (one process each) that split every layer (default 1; docs/tensor-parallel.md)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="engine replicas (one process each, with its share of the cores and KV memory) behind "
                   "the one endpoint; requests routed by prefix affinity, else to the least loaded (default 1)")
    g.add_argument("--nnodes", type=int, default=None,
                   help="hosts the tensor-parallel ranks span (default: $WORLD_SIZE under torchrun, else 1); "
                   "one launch per host, see docs/tensor-parallel.md")
    g.add_argument("--node-rank", type=int, default=None,
                   help="this host's index (default: $RANK, else 0); node 0 serves the API, others only compute")
    g.add_argument("--master-addr", default=None,
                   help="address of node 0, where the ranks meet (default: $MASTER_ADDR, else 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="port of the rendezvous on node 0 (default: $MASTER_PORT; required with --nnodes > 1)")
    g.add_argument("--execution-mode", choices=("compiled", "eager"), default=None,
                   help="eager (default; decode runs the fused C++ forward) or compiled (Inductor for the "
                   "module path, i.e. long prefill chunks; cached on disk)")
    g.add_argument("--enforce-eager", dest="execution_mode", action="store_const", const="eager",
                   help="vLLM's name for --execution-mode eager")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads per rank (default: by model size, cores // tensor-parallel size)")
    g.add_argument("--seed", type=int, default=None)


def config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    kwargs = {k: getattr(args, k) for k in ENGINE_FIELDS if getattr(args, k, None) is not None}
    return EngineConfig(model=model, **kwargs)


# LLM(...)'s keywords: EngineConfig's fields by their own names, and vLLM's names that map onto them
# (llm_kwargs); chat_template is the LLM's own (the default template of LLM.chat).
ENGINE_KEYWORDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model"}
VLLM_KWARGS = frozenset({"gpu_memory_utilization", "enforce_eager", "kv_cache_memory_bytes", "spec_method",
                         "spec_model", "spec_tokens", "chat_template"})


def llm_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's LLM(...) keywords as EngineConfig fields, and the LLM's own (chat_template).
    Our own field names (EngineConfig's) pass as they are; a keyword with neither is refused by name."""
    kw = dict(kwargs)
    own = {"chat_template": kw.pop("chat_template", None)}
    if "gpu_memory_utilization" in kw:
        # vLLM: the share of the device's memory the engine may take; here the KV cache's share of the memory
        # left free once the weights are loaded (--kv-cache-memory-fraction), the part that the knob sizes.
        v = kw.pop("gpu_memory_utilization")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 0.95:
            raise UnsupportedLever(f"gpu_memory_utilization={v!r}: give a share in (0, 0.95]; LeverLab gives "
                                   "that share of the memory free after loading the weights to the KV cache")
        kw["kv_cache_memory_fraction"] = float(v)
    if "enforce_eager" in kw:
        # True: no compilation (our eager mode). False is vLLM's default and leaves our own (eager unless
        # execution_mode="compiled" or LEVERLAB_EXECUTION_MODE say otherwise).
        if kw.pop("enforce_eager"):
            kw["execution_mode"] = "eager"
    if "kv_cache_memory_bytes" in kw:
        kw["kv_cache_memory"] = kw.pop("kv_cache_memory_bytes")
    spec = {k: kw.pop(f"spec_{k}") for k in ("method", "model", "tokens") if f"spec_{k}" in kw}
    spec = {k: v for k, v in spec.items() if v is not None}
    if spec:
        if kw.get("speculative_config"):
            raise UnsupportedLever("give speculative_config or spec_method/spec_model/spec_tokens, not both")
        kw["speculative_config"] = {"num_speculative_tokens" if k == "tokens" else k: v for k, v in spec.items()}
    unknown = sorted(set(kw) - ENGINE_KEYWORDS)
    if unknown:
        raise UnsupportedLever(
            f"LLM(): {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not supported by LeverLab "
            "(a vLLM option with no counterpart here, or a misspelling); remove "
            f"{'it' if len(unknown) == 1 else 'them'}. Accepted: {', '.join(sorted(ENGINE_KEYWORDS | VLLM_KWARGS))}")
    return kw, own
