"""Workload builders: seeded, exact lengths, the schema of the bundled prompt set, ShareGPT bucketing."""

from __future__ import annotations

import json

import pytest

from leverlab.bench import workloads as W
from leverlab.bench.config import BenchConfig
from leverlab.bench.runner import plan_phases


def test_buckets_sampling_is_seeded_and_per_bucket(make_workload):
    wl = make_workload(
        {"short": (8, [f"s{i}" for i in range(10)]), "long": (9, [f"l{i}" for i in range(10)])}
    )
    a = W.load_buckets(wl, num_prompts=4, seed=1)
    b = W.load_buckets(wl, num_prompts=4, seed=1)
    c = W.load_buckets(wl, num_prompts=4, seed=2)
    ids = lambda w, k: [r.id for r in w.buckets[k]]  # noqa: E731
    assert ids(a, "short") == ids(b, "short") and ids(a, "short") != ids(c, "short")
    # dropping a bucket does not change another bucket's draw
    assert ids(W.load_buckets(wl, buckets=["long"], num_prompts=4, seed=1), "long") == ids(a, "long")
    assert {r.output_len for r in a.buckets["long"]} == {9}
    assert W.load_buckets(wl, output_len=3).buckets["short"][0].output_len == 3
    assert len(W.load_buckets(wl).buckets["short"]) == 10  # default: the whole bucket
    more = W.load_buckets(wl, num_prompts=13, seed=0).buckets["short"]
    assert len(more) == 13 and len({r.id for r in more}) == 13  # repeats are marked
    assert a.description["sha256"] == W.file_sha256(wl)


def test_missing_prompt_set_and_unknown_bucket(make_workload, tmp_path):
    with pytest.raises(W.WorkloadError, match="prompt set not found"):
        W.load_buckets(tmp_path / "nope.json")
    assert W.default_workload_path().parts[-2:] == ("models", "workload.json")
    wl = make_workload({"short": (8, ["x"])})
    with pytest.raises(W.WorkloadError, match="not in"):
        W.load_buckets(wl, buckets=["medium"])


def test_plan_phases(make_workload):
    wl = W.load_buckets(make_workload({"short": (8, ["a", "b"]), "medium": (8, ["c", "d", "e"])}))
    ph = plan_phases(BenchConfig(concurrency=[1, 2, 4], sweep_rounds=2), wl)
    assert [(p.name, len(p.requests), p.concurrency) for p in ph] == [
        ("single/short", 2, 1),
        ("single/medium", 3, 1),
        ("sweep/medium/c1", 3, 1),
        ("sweep/medium/c2", 4, 2),
        ("sweep/medium/c4", 8, 4),
    ]
    # the sweep's concurrency-1 point sends exactly the single phase's requests: it reuses them
    assert [p.same_as for p in ph] == [None, None, "single/medium", None, None]
    assert plan_phases(BenchConfig(single=False, concurrency=[1]), wl)[0].same_as is None
    ph = plan_phases(BenchConfig(single=False, request_rates=[0.5, 2], sweep_bucket="short"), wl)
    assert [(p.name, p.rate) for p in ph] == [("poisson/short/r0.5", 0.5), ("poisson/short/r2", 2.0)]


def test_synthetic_and_shared_prefix_without_tokenizer():
    s = W.synthetic(input_len=50, output_len=7, num_prompts=5, seed=0)
    assert [len(r.prompt.split()) for r in s.buckets["synthetic"]] == [50] * 5
    assert (
        s.buckets["synthetic"][0].prompt
        == W.synthetic(input_len=50, output_len=7, num_prompts=5).buckets["synthetic"][0].prompt
    )
    v = W.synthetic(input_len=100, output_len=7, num_prompts=20, seed=0, range_ratio=0.5)
    lens = [len(r.prompt.split()) for r in v.buckets["synthetic"]]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 1
    sp = W.shared_prefix(prefix_len=200, suffix_len=10, output_len=5, num_prompts=4)
    reqs = sp.buckets["shared-prefix"]
    prefix = reqs[0].messages[0]["content"]
    assert all(r.messages[0]["content"] == prefix and r.prompt.startswith(prefix) for r in reqs)
    assert len({r.messages[1]["content"] for r in reqs}) == 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tests.checkpoints import make_tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return d


def test_exact_lengths_with_tokenizer(tokenizer_dir):
    tok = W.load_tokenizer(tokenizer_dir)
    s = W.synthetic(input_len=40, output_len=3, num_prompts=4, seed=0, tokenizer=tok)
    for r in s.buckets["synthetic"]:
        assert r.prompt_tokens == len(tok(r.prompt, add_special_tokens=False).input_ids)
        assert abs(r.prompt_tokens - 40) <= 2
    sp = W.shared_prefix(prefix_len=60, suffix_len=8, output_len=3, num_prompts=2, tokenizer=tok)
    for r in sp.buckets["shared-prefix"]:
        assert r.prompt_tokens == len(tok(r.prompt, add_special_tokens=False).input_ids) >= 68


def test_sharegpt_bucketing(tokenizer_dir, tmp_path):
    tok = W.load_tokenizer(tokenizer_dir)
    words = "def add(a, b): return a + b. The quick brown fox jumps over the lazy dog."

    def conv(n_words: int, i: int) -> dict:
        return {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": " ".join([words] * n_words)},
                {"from": "gpt", "value": words * 2},
            ],
        }

    data = [conv(1, 0), conv(1, 1), conv(6, 2), conv(6, 3), conv(40, 4), {"id": "bad", "conversations": []}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    edges = {"short": (4, 60), "medium": (60, 400), "long": (400, 5000), "decode": (4, 60)}
    wl = W.load_sharegpt(p, tok, num_prompts=2, seed=0, edges=edges, output_len=16, decode_output_len=64)
    b = wl.buckets
    for name, reqs in b.items():
        lo, hi = edges[name]
        assert all(lo <= r.prompt_tokens < hi for r in reqs), name
    assert len(b["medium"]) == 2 and len(b["long"]) == 1
    assert len(b["short"]) + len(b["decode"]) == 2  # each entry feeds one bucket
    assert {r.output_len for r in b["medium"]} == {16} and {r.output_len for r in b["decode"]} == {64}


def test_local_tokenizer_dir(tokenizer_dir, tmp_path):
    from leverlab.bench.runner import local_tokenizer_dir

    models = {"data": [{"id": "a", "root": str(tmp_path)}, {"id": "b", "root": str(tokenizer_dir)}]}
    assert local_tokenizer_dir(models, "b") == str(tokenizer_dir)
    assert local_tokenizer_dir(models, "a") is None  # a folder without a tokenizer
    assert local_tokenizer_dir({"data": [{"id": "x", "root": "Qwen/Qwen3-8B"}]}, "x") is None  # a hub name
    assert local_tokenizer_dir(None, "x") is None
