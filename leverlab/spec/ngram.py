"""N-gram (prompt lookup) proposer: if the last n tokens occurred earlier, propose what followed them.

Code and chat repeat themselves (identifiers, imports, quoted context), so the tokens after an earlier
occurrence of the current suffix are often what the model would write next. No model runs: the draft
costs only a search over the sequence's own tokens.
"""

from __future__ import annotations

from leverlab.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.prompt_token_ids + seq.output_token_ids
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
