"""Incremental detokenization against a whole decode, with the bundled model's real tokenizer."""

from transformers import AutoTokenizer

from leverlab.config import default_model_path
from leverlab.engine.detokenizer import Detokenizer

TOK = AutoTokenizer.from_pretrained(default_model_path())
CODE = 'def f(x):\n    """Naïve — ünïcödé ✓."""\n    return {"a": x ** 2}  # 日本語\n'


def stream(det: Detokenizer, prompt: list[int], outputs: list[int], skip: bool):
    state, got, spans = det.start(prompt), [], []
    for i in range(len(outputs)):
        got.append(det.step(state, prompt, outputs[: i + 1], skip))
        spans.append(state.read_offset - state.prefix_offset)
    return state, "".join(got), spans


def test_streamed_text_equals_whole_decode():
    det = Detokenizer(TOK)
    prompt = TOK.encode("# a prompt\n")
    outputs = TOK.encode(CODE)
    state, text, _ = stream(det, prompt, outputs, skip=True)
    assert text == state.text == TOK.decode(outputs, skip_special_tokens=True)


def test_skipped_special_tokens_move_the_window_on():
    # A model that emits special tokens (ignore_eos on a loop of EOS) decodes them to nothing; the window must
    # still advance, or every step re-decodes all of them (quadratic in the output length).
    det = Detokenizer(TOK)
    eos = TOK.eos_token_id if TOK.eos_token_id is not None else 0
    prompt = TOK.encode("x = 1\n")
    outputs = [eos] * 300 + TOK.encode(CODE) + [eos] * 50
    state, text, spans = stream(det, prompt, outputs, skip=True)
    assert max(spans) <= 8, max(spans)
    assert text == TOK.decode(outputs, skip_special_tokens=True)
    _, kept, _ = stream(det, prompt, outputs, skip=False)  # not skipped: the special tokens' own text is kept
    assert kept == TOK.decode(outputs, skip_special_tokens=False)
