"""`leverlab bench`: measure any OpenAI-compatible endpoint the way the reference study did.

    from leverlab.bench import BenchConfig, run_benchmark
    result = run_benchmark(BenchConfig(base_url="http://127.0.0.1:8000/v1", out_dir="results/x"))
    result.group("single/medium")["e2e_s"]["p50"]

Light to import: no torch, no matplotlib (loaded only when plots are written), no transformers (loaded
only when a workload needs token counts).

A tool over HTTP: may import the plain types, and models (peer_vllm writes a quantized checkpoint for vLLM);
study builds on it.
"""

from leverlab.bench.config import BenchConfig, BenchResult
from leverlab.bench.runner import arun_benchmark, run_benchmark

__all__ = ["BenchConfig", "BenchResult", "arun_benchmark", "run_benchmark"]
