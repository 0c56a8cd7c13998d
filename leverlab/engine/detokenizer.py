"""Incremental detokenization and stop strings.

Decoding a token alone can split a UTF-8 character or a merged word, so text is decoded over a short
window (prefix_offset..end) and only the part past read_offset is new. While a stop string could still
be completing, the last len(longest stop) - 1 characters are held back, so streamed text never has to
be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all text decoded so far (may run past a stop string until it is cut)
    emitted: int = 0  # characters of `text` released to the user


class Detokenizer:
    PROMPT_TAIL = 5  # prompt tokens decoded with the output, for context at the boundary

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The Rust tokenizer behind a fast Hugging Face tokenizer decodes the same text without the Python
        # wrapper's per-call argument handling (measured: ~0.1 ms of a ~2 ms decode step on the bundled model,
        # two calls per token). Only when the wrapper would not post-process (clean_up_tokenization_spaces).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False) else None

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def start(self, prompt_ids: list[int]) -> DetokState:
        # Seed the window with the prompt's tail, so the first output token decodes in context
        # (a leading space or a multi-byte character that straddles the boundary).
        return DetokState(prefix_offset=0, read_offset=len(self.window(prompt_ids, [])))

    def window(self, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
        """The ids step() decodes over: the prompt's tail (as seeded by start) + every output id."""
        return prompt_ids[-self.PROMPT_TAIL :] + output_ids

    def step(self, state: DetokState, all_ids: list[int], skip_special: bool) -> str:
        """all_ids = window(prompt, outputs). Returns the newly decoded text."""
        prefix = self.decode(all_ids[state.prefix_offset : state.read_offset], skip_special)
        full = self.decode(all_ids[state.prefix_offset :], skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            state.prefix_offset, state.read_offset = state.read_offset, len(all_ids)
            state.text += new
            return new
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last new_len characters: (its start index, the string)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
