from pathlib import Path

import pytest

from leverlab.train.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, render_chat, train_tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "leverlab-code-15m"
CODE = 'def f(x: int) -> str:\n    """Doc — ünïcode."""\n\treturn f"{x!r:>8}"  # tab\n\n\nclass A(B): pass\n'


@pytest.fixture(scope="module")
def small_tokenizer():
    import json.decoder
    import textwrap

    texts = [Path(json.decoder.__file__).read_text(), Path(textwrap.__file__).read_text()]
    return train_tokenizer(texts, vocab_size=400)


def test_special_tokens_have_fixed_ids_and_stay_whole(small_tokenizer):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert small_tokenizer.token_to_id(t) == i
    ids = small_tokenizer.encode("x<|im_start|>user\n<|im_end|><|endoftext|>", add_special_tokens=False).ids
    assert 1 in ids and 2 in ids and ids[-1] == 0


def test_round_trips_code_including_non_ascii(small_tokenizer):
    ids = small_tokenizer.encode(CODE, add_special_tokens=False).ids
    assert small_tokenizer.decode(ids, skip_special_tokens=False) == CODE


def test_chat_template_renders_chatml():
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n"
    assert render_chat(msgs, add_generation_prompt=True).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "add_generation_prompt" in CHAT_TEMPLATE


@pytest.mark.skipif(not (BUNDLED / "tokenizer.json").exists(), reason="bundled model not built yet")
def test_bundled_tokenizer_loads_in_transformers_with_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    assert len(tok) == 8192
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == 0
    msgs = [{"role": "user", "content": "Explain this function:\n```python\ndef f(): pass\n```"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == render_chat(msgs, add_generation_prompt=True)
    assert tok.decode(tok(CODE)["input_ids"]) == CODE
