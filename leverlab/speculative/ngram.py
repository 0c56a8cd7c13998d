"""N-gram (prompt lookup) proposer: if the last n tokens occurred earlier, propose what followed them.

Code and chat repeat themselves (identifiers, imports, quoted context), so the tokens after an earlier
occurrence of the current suffix are often what the model would write next. No model runs: the draft
costs only a search over the sequence's own tokens.
"""

from __future__ import annotations

from leverlab.core.sequence import Sequence
from leverlab.speculative.base import Draft


class NgramProposer:
    needs_features = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def from_config(cls, spec, engine_config, max_model_len: int) -> NgramProposer:
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(s.prompt_token_ids + s.output_token_ids, k)) for s, k in zip(seqs, ks)]

    def check_vocab(self, target_vocab: int) -> None:
        pass  # drafts are the sequence's own tokens

    def attach(self, runner) -> None:
        pass

    def observe(self, result) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        n_total = len(tokens)
        for n in range(min(self.max_n, n_total - 1), self.min_n - 1, -1):
            suffix = tokens[n_total - n :]
            # The most recent earlier occurrence wins: it is the likeliest to continue the same way.
            for start in range(n_total - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []
