"""The study collects fidelity over HTTP from each configuration's own server (study/fidelity.py): through a
real `leverlab serve` it must give what the Python API gives, token ids and prompt logprobs alike."""

from __future__ import annotations

import pytest

from leverlab.study import fidelity as F

PROMPTS = [
    {"id": "a", "text": "def add(a, b):\n    return a + b\n"},
    {"id": "b", "text": "for i in range(10):\n    print(i)"},
]


def test_http_collection_equals_the_in_process_one(server, checkpoint):
    got = F.collect_http(f"{server.url}/v1", None, PROMPTS, 8)
    levers = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "auto", "speculative": None,
              "prefix_caching": True, "tensor_parallel_size": 1, "max_num_seqs": 64}
    ref = F._worker(F.inprocess_spec(str(checkpoint), levers, PROMPTS, 8))
    assert got["unit"] == "tokens" and "logprobs_note" not in got
    for r, g in zip(ref["samples"], got["samples"]):
        assert g["output"] == r["output"] and all(t.isdigit() for t in g["output"])  # ids, not "token_id:N"
        assert g["prompt_tokens"] == r["prompt_tokens"]
        assert len(g["prompt_logprobs"]) == len(r["prompt_logprobs"])
        for dg, dr in zip(g["prompt_logprobs"], r["prompt_logprobs"]):
            assert (dg is None) == (dr is None)
            if dr is not None:
                assert dg.keys() == dr.keys()
                assert all(dg[k] == pytest.approx(dr[k], abs=1e-5) for k in dr)
    c = F.compare(ref, got)
    assert c["agreement"]["share_identical"] == 1.0 and c["kl"]["mean"] == pytest.approx(0.0, abs=1e-6)
