"""A stand-in for vLLM's offline API, just enough for scripts/vllm_inprocess.py: tests of bench_peer's vLLM worker
protocol run without vLLM. Each decode step takes 10 ms of engine time and each prompt token 0.1 ms, so the rates
the worker reports are known: 100 tok/s a sequence, 10,000 prompt tok/s. FAKE_VLLM_NO_METRICS=1 keeps no
per-request timestamps (the worker's wall-clock path); FAKE_VLLM_FAIL=1 fails at load, FAKE_VLLM_HANG=1 never
finishes loading."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

__version__ = "0.0.fake"
print("INFO fake vllm imported (a log line on stdout, as vLLM's logger writes)")  # must not reach the protocol


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False


class LLM:
    def __init__(self, model: str, **kwargs):
        if os.environ.get("FAKE_VLLM_HANG"):
            time.sleep(600)  # a load that never finishes
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("fake load failure")
        self.kwargs = kwargs
        print(f"INFO loading {model}")

    def generate(self, prompts, sp: SamplingParams, use_tqdm: bool = True):
        n = sp.max_tokens
        if os.environ.get("FAKE_VLLM_NO_METRICS"):
            time.sleep(0.05 + 0.01 * (n - 1))  # the same rates, on the wall clock: 0.05 s to the first token
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            metrics = None if os.environ.get("FAKE_VLLM_NO_METRICS") else SimpleNamespace(
                first_token_ts=5.0, last_token_ts=5.0 + 0.01 * (n - 1), first_token_latency=1e-4 * len(ids))
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * n)], metrics=metrics))
        return outs
