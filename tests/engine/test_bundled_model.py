"""The bundled default model loads in LeverLab and in transformers and agrees in float32."""

import pytest
import torch

from leverlab.config import default_model_path
from tests.engine.helpers import hf_greedy

BUNDLED = default_model_path()
pytestmark = pytest.mark.skipif(not (BUNDLED / "model.safetensors").is_file(),
                                reason="the bundled model is not trained/committed yet")


def test_bundled_model_parity_with_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leverlab import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(BUNDLED))
    prompt = "def read_config(path):\n    \"\"\"Read a configuration file.\"\"\"\n"
    ids = tok.encode(prompt)
    llm = LLM(str(BUNDLED), dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=0))[0]
    ref = AutoModelForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32).eval()
    expected = hf_greedy(ref, ids, 32)
    assert out.outputs[0].token_ids == expected
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0], -1)
    for pos in range(1, len(ids)):
        assert abs(out.prompt_logprobs[pos][ids[pos]].logprob - logp[pos - 1, ids[pos]].item()) < 1e-4
