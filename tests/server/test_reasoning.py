"""--reasoning-parser qwen3 / deepseek_r1: the split vLLM 0.32's parsers make (their answers on these texts,
recorded by running them), the same split streamed in any chunking (tags straddling chunks), and through a
real server whose tokenizer has <think> tags and a template that honours enable_thinking."""

from __future__ import annotations

import random

import openai
import pytest

from leverlab.server.reasoning import ReasoningParser
from tests.checkpoints import make_checkpoint

# (text, qwen3's (reasoning, content), deepseek_r1's) as vLLM 0.32's extract_reasoning returns them
VLLM = [
    ("<think>abc</think>\n\nanswer", ("abc", "\n\nanswer"), ("abc", "\n\nanswer")),
    ("abc</think>answer", ("abc", "answer"), ("abc", "answer")),
    ("no tags at all", ("no tags at all", None), ("no tags at all", None)),
    ("<think>unfinished", ("unfinished", None), ("unfinished", None)),
    ("<think>x</think>", ("x", None), ("x", None)),
    ("a</think>b</think>c", ("a", "bc"), ("a", "b</think>c")),
    ("</think>answer", (None, "answer"), ("", "answer")),
    ("", (None, None), ("", None)),
]


@pytest.mark.parametrize("text,qwen3,deepseek", VLLM)
def test_split_as_vllm(text, qwen3, deepseek):
    assert ReasoningParser("qwen3").split(text) == qwen3
    assert ReasoningParser("deepseek_r1").split(text) == deepseek
    # qwen3 with enable_thinking false is off for the request; deepseek_r1 does not read it
    assert ReasoningParser("qwen3").for_request({"enable_thinking": False}) is None
    assert ReasoningParser("deepseek_r1").for_request({"enable_thinking": False}) is not None


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_any_chunking_streams_the_same_split(name):
    rng = random.Random(0)
    texts = [t for t, _, _ in VLLM] + ["x<thi", "<think>ab</thi", "</thin", "a<think>b<</think>c</think", "<<</think>"]
    p = ReasoningParser(name)
    for text in texts:
        want = p.split(text)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(0, 5))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            s, r, c = p.stream(), "", ""
            for i, piece in enumerate(pieces):
                dr, dc = s.feed(piece, final=i == len(pieces) - 1)
                assert "<think>" not in dr and "</think>" not in dr, (text, pieces)
                r, c = r + dr, c + dc
            assert (r or None, c or None) == (want[0] or None, want[1]), (text, pieces)


def test_unknown_parser_refused():
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("granite")


# ---- through the server --------------------------------------------------------------------------------------

MODEL = "tiny-think"
END_ID = 385  # </think> in make_tokenizer(think_tags=True)
BIAS = 2.0  # on </think>: the random model then closes its reasoning after a few tokens (checked below)


@pytest.fixture(scope="module")
def think_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("think") / MODEL, think_tags=True)


@pytest.fixture(scope="module")
def think_server(think_ckpt, start_server):
    return start_server("--reasoning-parser", "qwen3", ckpt=think_ckpt)


@pytest.fixture(scope="module")
def client(think_server):
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _raw(client, chat_response) -> str:
    """The answer's text without the parser: the same prompt ids and settings through /v1/completions,
    which no reasoning parser touches (greedy, so the same tokens)."""
    r = client.completions.create(model=MODEL, prompt=chat_response.prompt_token_ids, max_tokens=24,
                                  temperature=0, logit_bias={str(END_ID): BIAS}, extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_reasoning_content_split_streamed_and_not(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0,
              logit_bias={str(END_ID): BIAS})
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    text = _raw(client, r)
    assert "</think>" in text and not text.startswith("</think>"), f"the test wants a split, got {text!r}"
    reasoning, _, rest = text.partition("</think>")
    reasoning = reasoning.replace("<think>", "")
    content = rest.replace("</think>", "") or None  # qwen3 drops late end tags
    msg = choice.message.model_dump()
    assert msg["reasoning_content"] == msg["reasoning"] == reasoning and msg["content"] == content
    rs, cs = [], []
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}):
        d = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        rs.append(d.get("reasoning_content") or "")
        cs.append(d.get("content") or "")
        assert (d.get("reasoning_content") or "") == (d.get("reasoning") or "")
    assert "".join(rs) == reasoning and ("".join(cs) or None) == content
    # include_reasoning false: the reasoning is dropped, the content stays
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "include_reasoning": False})
    msg = r.choices[0].message.model_dump()
    assert msg.get("reasoning_content") is None and msg["content"] == content


def test_enable_thinking_false_reaches_the_template_and_turns_the_parser_off(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0,
              logit_bias={str(END_ID): BIAS})
    off = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    # the template closed an empty think block in the prompt
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    msg = off.choices[0].message.model_dump()
    assert msg.get("reasoning_content") is None and msg["content"] == _raw(client, off)
    assert on.choices[0].message.model_dump()["reasoning_content"]  # no </think>: all of it is reasoning
