"""One sequence's grammar state: a matcher advanced by every token the sequence emits."""

from __future__ import annotations

import torch


class SequenceGrammar:
    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...], mask_vocab: int | None = None):
        """vocab_size: the logits' width; mask_vocab: the grammar tokenizer's (its masks' width), when larger."""
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.words = (max(vocab_size, mask_vocab or 0, 1) + 31) // 32
        self._mask: torch.Tensor | None = None  # the allowed tokens in the current state, once computed
        self._banned: torch.Tensor | None = None  # the same as bool [32 * words], True where not allowed

    @property
    def has_mask(self) -> bool:
        return self._mask is not None

    def bitmask(self) -> torch.Tensor:
        """int32 [words]: the current state's allowed tokens, one bit each (token 32 w + b is bit b of word w);
        computed once per state (on the prefetch thread while the model runs, or here)."""
        if self._mask is None:
            row = torch.zeros(self.words, dtype=torch.int32)
            if self.matcher.is_error():
                # A token the grammar refused got in (min_tokens banned the only end it allowed): end it.
                for t in self.eos_token_ids:
                    if t < self.words * 32:
                        row[t >> 5] |= _bit(t & 31)
            else:
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            self._mask = row
        return self._mask

    def allows(self, token: int) -> bool:
        """Whether the current state allows `token` (one bit read: no bool row built)."""
        if token >= self.words * 32:
            return False
        return bool((int(self.bitmask()[token >> 5]) >> (token & 31)) & 1)

    def banned(self) -> torch.Tensor:
        """bool [32 * words]: True for the tokens the grammar does not allow next (cached for this state)."""
        if self._banned is None:
            self._banned = ~unpack(self.bitmask()[None])[0]
        return self._banned

    def accept(self, tokens: list[int]) -> bool:
        """Advance by emitted tokens. False if one was not allowed (the matcher is then in error: it allows
        only end-of-sequence from there on)."""
        if not tokens:
            return True
        self._mask = self._banned = None
        return bool(self.matcher.consume_tokens(tokens))

    def try_accept(self, tokens: list[int]) -> int:
        """Advance by as many of `tokens` as the grammar allows (drafts); returns that count, no error state."""
        n = self.matcher.try_consume_tokens(tokens) if tokens else 0
        if n:
            self._mask = self._banned = None
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self._mask = self._banned = None

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces from here: while its mask allows exactly one token, consume it. Those are
        the tokens plain constrained decoding would pick too (greedy or sampled: masked, nothing else has any
        probability), so appending them is lossless. Ends after an end-of-sequence token. The mask where it
        stops is kept for the sampler."""
        out: list[int] = []
        while len(out) < limit and not self.matcher.is_error():
            raw = self.matcher.compute_bitmask()  # token t is bit t of the little-endian bytes
            bits = int.from_bytes(raw, "little")
            if bits.bit_count() != 1:
                self._mask = torch.frombuffer(bytearray(raw), dtype=torch.int32)[: self.words]
                break
            tok = bits.bit_length() - 1
            out.append(tok)
            if tok in self.eos_token_ids or not self.accept([tok]):
                break
        return out


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _bit(b: int) -> int:
    """Bit b of an int32 word as a Python int in int32's range (bit 31 is the sign)."""
    return -(1 << 31) if b == 31 else 1 << b


def unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """int32 [B, W] bit words (llguidance's layout: token 32 * w + b is bit b of word w) -> bool [B, 32 W]."""
    return ((bitmask[:, :, None] >> _SHIFTS) & 1).view(bitmask.shape[0], -1).bool()
