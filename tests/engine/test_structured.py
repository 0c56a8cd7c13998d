"""Structured output in the engine (Python API): grammar masks per sequence, jump-forward over forced tokens
and speculation under the mask are all lossless: the same tokens (float32) with each of them on and off."""

import json

import jsonschema
import pytest

from leverlab import LLM, SamplingParams, StructuredOutputsParams
from tests.checkpoints import make_eagle_head

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "kind": {"type": "string", "enum": ["alpha_function", "beta_function"]},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 6}}}}
PROMPTS = ["def add(a, b):", "for i in range(10):", [5, 6, 7, 8] * 5, "def add(a, b):"]  # a repeat: prefix hit


def _params(**kw):
    return SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def _run(path, **engine_kw):
    llm = LLM(path, dtype="float32", **engine_kw)
    greedy = llm.generate(PROMPTS, _params(temperature=0))
    sampled = llm.generate(PROMPTS[:2], _params(temperature=1.0, seed=11, n=3))
    eng = llm.engine
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.check_invariants()
    steps = eng.counter_snapshot()["steps"]
    llm.close()
    return [list(o.outputs[0].token_ids) for o in greedy], [[list(c.token_ids) for c in o.outputs]
                                                            for o in sampled], greedy, steps


@pytest.fixture(scope="module")
def path(checkpoint_factory):
    return checkpoint_factory("qwen3")


@pytest.fixture(scope="module")
def reference(path):
    return _run(path, structured_outputs_jump_forward=False)


def test_outputs_follow_the_schema(reference):
    _, sampled, greedy, _ = reference
    for o in greedy:
        assert o.outputs[0].finish_reason == "stop"  # the grammar ends the sequence (EOS only once complete)
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert all(len(s) == 3 for s in sampled)


def test_jump_forward_is_token_identical_and_saves_passes(path, reference):
    greedy, sampled, _, steps = _run(path)
    assert greedy == reference[0]
    assert sampled == reference[1]  # forced tokens are taken without a draw either way
    assert steps < reference[3]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculation_under_the_mask_is_token_identical(path, reference, method, checkpoint_factory, tmp_path):
    if method == "ngram":
        sc = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    elif method == "draft_model":
        sc = {"method": "draft_model", "model": checkpoint_factory("qwen3", num_hidden_layers=1),
              "num_speculative_tokens": 3}
    else:
        sc = {"method": "eagle", "model": make_eagle_head(path, tmp_path / "head"), "num_speculative_tokens": 3}
    for jf in (True, False):
        llm = LLM(path, dtype="float32", speculative_config=sc, structured_outputs_jump_forward=jf)
        outs = llm.generate(PROMPTS, _params(temperature=0))
        assert [list(o.outputs[0].token_ids) for o in outs] == reference[0], (method, jf)
        sampled = llm.generate(PROMPTS[:2], _params(temperature=1.0, seed=3, n=2))
        for o in sampled:
            for c in o.outputs:
                jsonschema.validate(json.loads(c.text), SCHEMA)
        eng = llm.engine
        assert eng.counter_snapshot()["spec_draft_tokens"] > 0
        assert eng.blocks.num_free == eng.blocks.num_blocks
        llm.close()


def test_bad_grammar_is_a_request_error(path):
    from leverlab.errors import RequestError

    llm = LLM(path, dtype="float32")
    with pytest.raises(RequestError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(open")))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    llm.close()


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_greedy_rows_skip_the_mask_only_where_the_masked_argmax_is_the_same(path, kernels, monkeypatch):
    """The sampler's shortcut: a greedy row without logprobs gets its token under the grammar without its row
    being masked; every other row (logprobs asked, sampled) is masked in place as before. With the C++ kernels
    (bitmask_argmax, apply_bitmask_) and without them (PyTorch)."""
    import torch

    from leverlab.kernels import cpu_kernels
    from leverlab.structured import masking

    if kernels == "torch":
        monkeypatch.setattr(masking, "_kernels", lambda logits: None)
    elif cpu_kernels.kernels() is None:  # (CI requires them: conftest fails the run when they do not build)
        pytest.skip("C++ kernels not built here")
    from transformers import AutoTokenizer

    from leverlab.core.sequence import Sequence
    from leverlab.structured.compiler import GrammarCompiler
    from leverlab.structured.masking import mask_batch

    tok = AutoTokenizer.from_pretrained(path)
    vocab = len(tok) + 7  # a model vocabulary padded past the tokenizer's
    compiler = GrammarCompiler(tok, vocab, (tok.eos_token_id,))
    so = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    kinds = [dict(temperature=0), dict(temperature=0), dict(temperature=0, logprobs=2), dict(temperature=1.0),
             dict(temperature=1.0)]
    seqs = []
    for i, kw in enumerate(kinds):
        if i == 4:  # one answer: its first token forced
            so = StructuredOutputsParams(choice=["alpha"])
        s = Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_token_ids=[1, 2], params=SamplingParams(**kw),
                     generator=None)
        s.grammar = compiler.new_state(so)
        seqs.append(s)
    allowed = (~seqs[0].grammar.banned()[:vocab]).nonzero()[:, 0].tolist()
    banned_tok = next(t for t in range(vocab) if t not in allowed)
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(len(seqs), vocab, generator=gen)
        # row 0's argmax allowed, row 1's banned (the shortcut must then mask it); other rows random
        logits[0, allowed[trial % len(allowed)]] = 50.0
        logits[1, banned_tok] = 50.0
        argmax = logits.argmax(dim=-1).tolist()
        ref = logits.clone()
        banned = torch.stack([s.grammar.banned()[:vocab] for s in seqs])
        ref_forced, ref_argmax = mask_batch(ref, seqs, None)
        assert torch.equal(ref, logits.masked_fill(banned, float("-inf")))
        assert ref_argmax is None
        got = logits.clone()
        forced, got_argmax = mask_batch(got, seqs, argmax)
        assert forced == ref_forced and list(forced) == [4]
        assert forced[4] == tok.encode("alpha", add_special_tokens=False)[0]
        assert got_argmax[:3] == ref.argmax(dim=-1).tolist()[:3]
        assert got_argmax[0] in allowed and got_argmax[1] in allowed
        assert torch.equal(got[2:], ref[2:])  # logprobs and sampled rows are masked as before
        assert torch.equal(got[0], logits[0])  # the shortcut row was left as it came
