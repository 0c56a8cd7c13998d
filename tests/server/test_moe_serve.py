"""An MoE checkpoint served over HTTP through the official client, at one rank and at --tensor-parallel-size 2
(the same greedy tokens); an MoE model whose experts do not split over the ranks refused at start with a message
(exit 2, no traceback) instead of a crash in a rank."""

import subprocess
import sys

import httpx
import openai
import pytest

from leverlab.models.config import ModelConfig
from tests.server.conftest import ROOT, ServerProcess, free_port


@pytest.fixture(scope="module")
def moe_checkpoint(checkpoint_factory):
    return checkpoint_factory("qwen3-moe")


def test_moe_model_served(moe_checkpoint, tmp_path):
    """Served through the official client; /metrics counts the experts its decode passes read (one sequence: top-k
    per sparse layer) and the weight bytes they make, consistent with the tokens generated."""
    cfg = ModelConfig.from_folder(moe_checkpoint)
    server = ServerProcess(moe_checkpoint, log_path=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model=client.models.list().data[0].id, prompt="def f(x):", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        m = server.metrics()
        passes = m["leverlab_engine_moe_decode_passes_total"]
        assert passes == 7  # the first of the 8 tokens comes from the prefill pass
        assert m["leverlab_engine_moe_experts_read_total"] == passes * sum(cfg.sparse_layers) * cfg.num_experts_per_tok
        # float32: the active-weight estimate less the untied embedding table (read a row per token), plus the q/k
        # norms it leaves out
        per_pass = 4 * (cfg.num_params(active=True) - cfg.vocab_size * cfg.hidden_size + cfg.num_layers * 2 * cfg.head_dim)
        assert m["leverlab_engine_moe_weight_bytes_read_total"] == passes * per_pass
        assert m["leverlab_engine_moe_decode_passes_uncounted_total"] == 0
        assert "# HELP leverlab_engine_moe_weight_bytes_read_total Weight bytes" in httpx.get(server.url + "/metrics").text
        chat = client.chat.completions.create(model=r.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens >= 1
    finally:
        assert server.stop() == 0, server.log()


def test_moe_model_served_at_two_ranks(moe_checkpoint, tmp_path):
    """--tensor-parallel-size 2: the experts sharded over two worker processes; float32 greedy text equals one
    rank's (an in-process engine here)."""
    from leverlab import LLM, SamplingParams

    with LLM(moe_checkpoint, dtype="float32") as llm:
        expected = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    server = ServerProcess(moe_checkpoint, "--tensor-parallel-size", "2", log_path=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model=client.models.list().data[0].id, prompt="def f(x):", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        assert r.choices[0].text == expected.outputs[0].text
    finally:
        assert server.stop() == 0, server.log()


def test_tensor_parallel_refused_for_experts_that_do_not_split(checkpoint_factory):
    path = checkpoint_factory("qwen3-moe", moe_intermediate_size=33)
    cmd = [sys.executable, "-m", "leverlab.cli", "serve", str(path), "--port", str(free_port()),
           "--tensor-parallel-size", "2"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("--tensor-parallel-size 2 with experts 33 wide was not refused: the server started")
    assert p.returncode == 2, err
    assert "moe_intermediate_size 33" in err and "Traceback" not in err, err
