"""Compile a request's StructuredOutputsParams into a grammar matcher, once per distinct grammar text.

llguidance (guidance-ai, MIT) does the work: it builds a token trie from the tokenizer (~tens of ms for a
150K vocabulary, once per engine) and compiles a grammar lazily, so a compile is cheap and a mask costs
tens of microseconds. A compiled grammar is kept as a pristine matcher; each sequence gets a deep copy.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf

from leverlab.sampling_params import StructuredOutputsParams
from leverlab.structured.state import SequenceGrammar

# The grammar engines we can use, by the name vLLM's --structured-outputs-config backend takes. One today:
# llguidance has CPU wheels with no dependencies (xgrammar's pulls triton), and vLLM ships both.
BACKENDS = ("guidance",)
CACHE_SIZE = 256  # compiled grammars kept (LRU); a matcher of a JSON schema is tens of KB


class GrammarError(ValueError):
    """The request's grammar does not compile (bad schema, regex or Lark text): a 400 for the client."""


class GrammarCompiler:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf, self.vocab_size, self.eos_token_ids = hf_tokenizer, vocab_size, tuple(eos_token_ids)
        self._tok = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # the server may compile on worker threads while the engine steps
        self.hits = self.misses = 0

    def _tokenizer(self):
        if self._tok is None:
            # n_vocab: the logits' width (the model's vocabulary can be padded past the tokenizer's)
            self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=max(self.vocab_size, len(self._hf)),
                                                     eos_token=list(self.eos_token_ids) or None)
        return self._tok

    def compile(self, so: StructuredOutputsParams):
        """The pristine matcher for `so` (cached); GrammarError if it does not compile."""
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
            tok = self._tokenizer()
        kind, text = key
        try:
            if kind == "json":
                # Compact JSON, no free whitespace (vLLM's default allows any): a small model otherwise can
                # emit whitespace until max_tokens and never close the object.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": False})
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.loads(text))
            else:
                grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", text)
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        except Exception as e:  # noqa: BLE001 - whatever the grammar engine says of a client's grammar is a 400
            raise GrammarError(f"structured output: {kind} does not compile: {e}") from e
        if matcher.is_error():
            raise GrammarError(f"structured output: {kind} does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def counters(self) -> dict[str, float]:
        return {"structured_grammar_cache_hits": self.hits, "structured_grammar_cache_misses": self.misses}

    def new_state(self, so: StructuredOutputsParams) -> SequenceGrammar:
        """A fresh matcher for one sequence."""
        return SequenceGrammar(self.compile(so).deep_copy(), self.vocab_size, self.eos_token_ids,
                               self._tokenizer().vocab_size)
