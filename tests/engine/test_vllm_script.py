"""A script written for vLLM's offline API (tests/engine/scripts/vllm_offline.py: basic generate, greedy by
keyword, chat, logprobs), with only its import line changed, runs unmodified as its own process. Its model,
"Qwen/Qwen3-0.6B", is a tiny random checkpoint put under that id in a Hub-layout cache (offline), and its greedy
tokens are checked against the same checkpoint loaded here from its folder."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from leverlab import LLM, SamplingParams
from tests.checkpoints import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "vllm_offline.py"


def test_vllm_offline_script_runs_unmodified(checkpoint_factory, tmp_path):
    ckpt = checkpoint_factory("qwen3")
    source = SCRIPT.read_text()
    imports = [ln for ln in source.splitlines() if ln.startswith(("from ", "import "))]
    assert imports == ["from leverlab import LLM, SamplingParams"]  # the one line that differs from vLLM's
    add_to_hub_cache(tmp_path / "hf" / "hub", "Qwen/Qwen3-0.6B", Path(ckpt))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = r.stdout

    # basic: four prompts, each with its sampled text
    assert out.count("Prompt: ") == 4 + 1 and out.count("Generated text: ") == 4 + 1  # + the chat's one
    assert "Prompt: 'The capital of France is'" in out

    # greedy by keyword: the same tokens as this process gets from the checkpoint's folder
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    with LLM(ckpt, max_model_len=512, enforce_eager=True) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
        chat_prompt = llm.tokenizer.apply_chat_template(
            [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": "Hello! How can I assist you today?"},
             {"role": "user", "content": "Write an essay about the importance of higher education."}],
            tokenize=False, add_generation_prompt=True)
    got = [ast.literal_eval(m) for m in re.findall(r"^GREEDY (\[.*\])$", out, re.M)]
    assert got == want

    # chat: the rendered conversation is the prompt; a batch of three identical greedy chats agree
    assert f"Prompt: {chat_prompt!r}" in out
    assert "CHAT BATCH 3 1" in out

    # logprobs: vLLM's Logprob objects, greedy picks rank 1, cumulative is their sum
    assert "PROMPT LOGPROBS FIRST None" in out
    tokens = re.findall(r"^TOKEN (\d+) .* logprob=(-?[\d.]+) rank=(\d+) alternatives=(\d+)", out, re.M)
    assert len(tokens) == 8 and all(rank == "1" and int(n) in (5, 6) for _, _, rank, n in tokens)
    cumulative = float(re.search(r"^CUMULATIVE (-?[\d.]+)$", out, re.M).group(1))
    assert abs(cumulative - sum(float(lp) for _, lp, _, _ in tokens)) < 1e-3
    assert re.search(r"^REPR \{\d+: Logprob\(logprob=-?[\d.e-]+, rank=1, decoded_token='", out, re.M)
