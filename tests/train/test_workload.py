import json
from pathlib import Path

import pytest

from leverlab.train.corpus import load_splits

MODELS = Path(__file__).resolve().parents[2] / "models"
WORKLOAD = MODELS / "workload.json"
pytestmark = pytest.mark.skipif(not WORKLOAD.exists(), reason="workload not built yet")


@pytest.fixture(scope="module")
def workload():
    return json.loads(WORKLOAD.read_text())


def test_schema(workload):
    prov = workload["provenance"]
    assert prov["source"].startswith("CPython ") and prov["source"].endswith("stdlib, held-out split")
    assert prov["seed"] == 0 and prov["tokenizer"] == "leverlab-code-15m"
    assert prov["created_by"] == "leverlab train-default --stage workload"
    expected = {"short": (64, 256), "medium": (512, 256), "long": (1500, 256), "decode": (64, 1024)}
    assert set(workload["buckets"]) == set(expected)
    for name, (n_in, n_out) in expected.items():
        b = workload["buckets"][name]
        assert (b["input_tokens"], b["output_len"]) == (n_in, n_out)
        assert 24 <= len(b["prompts"]) <= 32
        for p in b["prompts"]:
            assert set(p) == {"id", "source", "text", "num_tokens"} and p["num_tokens"] == n_in
            assert p["id"].startswith(f"{name}-")
    assert len(workload["chat"]) >= 20
    for c in workload["chat"]:
        assert c["kind"] in {"explain", "write"} and c["messages"][0]["role"] == "user"
    ids = [p["id"] for b in workload["buckets"].values() for p in b["prompts"]] + [
        c["id"] for c in workload["chat"]
    ]
    assert len(ids) == len(set(ids))
    assert WORKLOAD.stat().st_size < 2_000_000


def test_num_tokens_exact_with_bundled_tokenizer(workload):
    from tokenizers import Tokenizer

    path = MODELS / "leverlab-code-15m" / "tokenizer.json"
    if not path.exists():
        pytest.skip("bundled tokenizer not exported yet")
    tok = Tokenizer.from_file(str(path))
    for b in workload["buckets"].values():
        for p in b["prompts"]:
            assert len(tok.encode(p["text"], add_special_tokens=False).ids) == p["num_tokens"], p["id"]


def test_prompts_come_only_from_heldout_files(workload):
    splits = load_splits()
    heldout = {f.rel for f in splits["heldout"]}
    trained = {f.rel for f in splits["train"]}
    sources = {p["source"] for b in workload["buckets"].values() for p in b["prompts"]}
    sources |= {c["source"] for c in workload["chat"]}
    assert sources <= heldout and not (sources & trained)
