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
        return DetokState(prefix_offset=0, read_offset=min(len(prompt_ids), self.PROMPT_TAIL))

    def step(self, state: DetokState, prompt_ids: list[int], output_ids: list[int], skip_special: bool) -> str:
        """Decode the newest output tokens; returns the newly decoded text. Offsets index the window (the
        prompt's tail, as seeded by start, then every output id), which is sliced here rather than built:
        copying every output id per token made a long generation quadratic."""
        tail = prompt_ids[-self.PROMPT_TAIL:] if prompt_ids else []
        p = len(tail)

        def window(a: int, b: int) -> list[int]:
            return output_ids[a - p: b - p] if a >= p else tail[a:b] + output_ids[: max(0, b - p)]

        end = p + len(output_ids)
        prefix = self.decode(window(state.prefix_offset, state.read_offset), skip_special)
        full = self.decode(window(state.prefix_offset, end), skip_special)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""  # a character still incomplete: wait for its next bytes
        # Tokens that decode to nothing (special tokens skipped) still move the window on: holding it back
        # re-decoded every such token at every step (a run of 512 of them took 0.3 ms per step).
        new = full[len(prefix):]
        state.prefix_offset, state.read_offset = state.read_offset, end
        state.text += new
        return new


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last new_len characters: (its start index, the string)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
