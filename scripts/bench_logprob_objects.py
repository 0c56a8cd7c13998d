"""What LLM's vLLM-shaped logprobs cost: the engine keeps {token: float}, LLM hands out {token: Logprob} objects
with ranks and decoded tokens. One request of a 1,000-token prompt with prompt_logprobs=20 and 64 output tokens
with logprobs=5 on the bundled model (bfloat16), rounds interleaved: the engine's time, then the conversion's
(its decoded-token cache cleared each round, so each is a cold conversion).

    python scripts/bench_logprob_objects.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from leverlab import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(dtype="bfloat16")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = llm.tokenizer.encode(readme)[:1000]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, prompt_logprobs=20, logprobs=5)
    engine_s, convert_s = [], []
    for r in range(args.rounds):
        llm.engine.add_request(f"r{r}", ids, sp)
        t0 = time.perf_counter()
        raw = None
        while llm.engine.has_unfinished():
            for out in llm.engine.step(final_only=True):
                raw = out
        t1 = time.perf_counter()
        llm._token_text.clear()
        llm._vllm_shape(raw)
        convert_s.append(time.perf_counter() - t1)
        engine_s.append(t1 - t0)
    e, c = min(engine_s), min(convert_s)
    print(f"{len(ids)} prompt positions x 21, 64 output positions x 6 entries; best of {args.rounds}:")
    print(f"  engine {1e3 * e:.0f} ms, Logprob conversion {1e3 * c:.1f} ms: {100 * c / e:.1f}% on top")


if __name__ == "__main__":
    main()
