"""Fidelity math on constructed outputs and logprobs: exact numbers."""

from __future__ import annotations

import math

import pytest

from leverlab.study.fidelity import (
    compare,
    exactness,
    first_divergence,
    kl_topk,
    mean_kl,
    perplexity,
    token_agreement,
)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([], []) is None


def test_token_agreement_counts_identical_outputs_at_full_length():
    ref = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 3, 4], [1, 2, 0, 0], [9, 6, 7, 8]]
    a = token_agreement(ref, got)
    assert a["identical"] == 1 and a["share_identical"] == pytest.approx(1 / 3)
    assert a["mean_first_divergence"] == pytest.approx((4 + 2 + 0) / 3)
    assert a["mean_first_divergence_diverged"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        token_agreement([[1]], [])


def test_perplexity_is_exp_of_mean_negative_logprob():
    lps = [None, {"5": math.log(0.5), "6": math.log(0.25)}, {"7": math.log(0.25)}]
    # position 0 has no distribution; targets 6 and 7 have p = 0.25 each -> perplexity 4
    assert perplexity(lps, ["1", "6", "7"]) == pytest.approx(4.0)
    assert math.isnan(perplexity([None], ["1"]))


def test_kl_of_identical_distributions_is_zero():
    p = {"a": math.log(0.6), "b": math.log(0.3)}
    assert kl_topk(p, dict(p)) == pytest.approx(0.0, abs=1e-12)


def test_kl_topk_exact_on_a_three_outcome_coarse_graining():
    # P = (0.5, 0.3, rest 0.2), Q = (0.25, 0.25, rest 0.5) over {a, b, rest}
    p = {"a": math.log(0.5), "b": math.log(0.3)}
    q = {"a": math.log(0.25), "b": math.log(0.25)}
    want = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    assert kl_topk(p, q) == pytest.approx(want, rel=1e-12)


def test_kl_topk_uses_only_tokens_known_on_both_sides_and_is_a_lower_bound():
    # full distributions: P = (0.5, 0.3, 0.2), Q = (0.2, 0.3, 0.5); Q's list lacks "a"
    full = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(1) + 0.2 * math.log(0.2 / 0.5)
    p = {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)}
    q = {"b": math.log(0.3), "c": math.log(0.5)}
    got = kl_topk(p, q)
    # merged: {b, c, rest}: P = (0.3, 0.2, 0.5), Q = (0.3, 0.5, 0.2)
    want = 0.2 * math.log(0.2 / 0.5) + 0.5 * math.log(0.5 / 0.2)
    assert got == pytest.approx(want, rel=1e-12)
    assert got <= full + 1e-12


def test_mean_kl_skips_position_zero():
    p = {"a": math.log(0.5), "b": math.log(0.3)}
    q = {"a": math.log(0.25), "b": math.log(0.25)}
    m = mean_kl([None, p, p], [None, p, q])
    assert m["positions"] == 2 and m["mean"] == pytest.approx(kl_topk(p, q) / 2) and m["max"] == kl_topk(p, q)


def _sample(id_, out, lps=None, toks=None):
    s = {"id": id_, "output": out}
    if lps is not None:
        s["prompt_logprobs"], s["prompt_tokens"] = lps, toks
    return s


def test_compare_against_the_baseline():
    lp_base = [None, {"1": math.log(0.5), "2": math.log(0.25)}]
    lp_cfg = [None, {"1": math.log(0.25), "2": math.log(0.5)}]
    base = {
        "samples": [_sample("a", ["1", "2"], lp_base, ["0", "2"]), _sample("b", ["3"], lp_base, ["0", "1"])]
    }
    cfg = {
        "source": "test",
        "samples": [_sample("a", ["1", "2"], lp_cfg, ["0", "2"]), _sample("b", ["4"], lp_cfg, ["0", "1"])],
        "exactness": exactness([["1"]], [["1"]]),
    }
    c = compare(base, cfg)
    assert c["agreement"]["share_identical"] == 0.5
    assert c["perplexity_baseline"] == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.5)) / 2))
    assert c["perplexity"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.25)) / 2))
    assert c["kl"]["positions"] == 2 and c["kl"]["mean"] > 0
    assert c["exactness"]["exact"] is True


def test_compare_without_prompt_logprobs_says_so():
    base = {"samples": [_sample("a", ["x"])]}
    cfg = {"samples": [_sample("a", ["x"])], "logprobs_note": "the server returned no prompt_logprobs"}
    c = compare(base, cfg)
    assert c["kl"] is None and "no prompt_logprobs" in c["logprobs_note"]


def test_exactness_flags_any_difference():
    assert exactness([[1, 2], [3]], [[1, 2], [3]])["exact"] is True
    bad = exactness([[1, 2], [3]], [[1, 9], [3]])
    assert bad["exact"] is False and bad["identical"] == 1


def _server(prompt_logprobs: bool, refuse_field: bool = False):
    """A stand-in OpenAI server: vLLM's shapes (logprobs.tokens; prompt_logprobs keyed by token id)."""
    import json as _json

    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = _json.loads(request.content)
        if "prompt_logprobs" in body and refuse_field:
            return httpx.Response(400, json={"error": {"message": "prompt_logprobs is not supported"}})
        choice = {"text": "ab", "logprobs": {"tokens": ["a", "b"][: body["max_tokens"]]}}
        if prompt_logprobs and "prompt_logprobs" in body:
            choice["prompt_logprobs"] = [None, {"7": {"logprob": math.log(0.5), "rank": 1}}]
            choice["prompt_token_ids"] = [3, 7]
        return httpx.Response(200, json={"choices": [choice]})

    return httpx.MockTransport(handler)


def test_collect_http_reads_vllm_prompt_logprobs():
    from leverlab.study.fidelity import collect_http

    res = collect_http("http://x/v1", None, [{"id": "p", "text": "hi"}], 2, transport=_server(True))
    s = res["samples"][0]
    assert s["output"] == ["a", "b"] and s["prompt_tokens"] == ["3", "7"]
    assert s["prompt_logprobs"][1] == {"7": math.log(0.5)} and "logprobs_note" not in res
    assert perplexity(s["prompt_logprobs"], s["prompt_tokens"]) == pytest.approx(2.0)


def test_collect_http_without_prompt_logprobs_says_so():
    from leverlab.study.fidelity import collect_http

    for refuse in (False, True):
        res = collect_http(
            "http://x/v1", "m", [{"id": "p", "text": "hi"}], 2, transport=_server(False, refuse)
        )
        assert res["samples"][0]["output"] == ["a", "b"] and "prompt_logprobs" not in res["samples"][0]
        assert "no prompt_logprobs" in res["logprobs_note"]


def test_exactness_pairs_run_in_one_worker_and_share_the_plain_run(checkpoint_factory, tmp_path):
    """The study's end-of-run pass: several speculative configurations' float32 pairs in one process; two that
    differ only in their speculation share one plain run; a broken one fails alone."""
    from leverlab.study.fidelity import collect_exactness

    ckpt = checkpoint_factory("qwen3")
    base = {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "auto", "prefix_caching": True,
            "tensor_parallel_size": 1, "max_num_seqs": 8}
    prompts = [{"id": "a", "text": "def f(x):\n    return x\ndef f(x):\n    return"}]
    jobs = [
        {"name": "k3", "model": ckpt, "levers": {**base, "speculative": {"method": "ngram", "num_speculative_tokens": 3}}},
        {"name": "k2", "model": ckpt, "levers": {**base, "speculative": {"method": "ngram", "num_speculative_tokens": 2}}},
        {"name": "bad", "model": ckpt, "levers": {**base, "speculative": {"method": "no-such-method"}}},
    ]
    got = collect_exactness([{**j, "prompts": prompts, "tokens": 12} for j in jobs], tmp_path)
    assert got["k3"]["exactness"]["exact"] is True and got["k3"]["plain_reused"] is False
    assert got["k2"]["exactness"]["exact"] is True and got["k2"]["plain_reused"] is True
    assert "no-such-method" in got["bad"]["error"]


def test_inprocess_collection_has_samples_logprobs_and_exactness(checkpoint_factory, tmp_path):
    """`--fidelity inprocess`: the served run through the Python API (ids, prompt logprobs) and, for a
    speculative configuration, its float32 pair, in one worker process."""
    from leverlab.study.fidelity import collect_inprocess

    levers = {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "auto", "prefix_caching": True,
              "tensor_parallel_size": 1, "max_num_seqs": 8,
              "speculative": {"method": "ngram", "num_speculative_tokens": 3}}
    prompts = [{"id": "a", "text": "def f(x):\n    return x\ndef f(x):\n    return"}]
    got = collect_inprocess(checkpoint_factory("qwen3"), levers, prompts, 10, tmp_path)
    s = got["samples"][0]
    assert len(s["output"]) == 10 and all(t.isdigit() for t in s["output"])
    assert len(s["prompt_logprobs"]) == len(s["prompt_tokens"]) and s["prompt_logprobs"][0] is None
    assert got["exactness"]["exact"] is True and (tmp_path / "fidelity.log").is_file()
