"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance, one matcher per
sequence, and the token masks the sampler and speculative verification apply.

  compiler.py  GrammarCompiler: the engine's tokenizer as llguidance sees it, and compiled grammars cached by
               their text (the backend registry is there too)
  state.py     SequenceGrammar: one sequence's matcher, its mask, what it forces
  masking.py   what the step loop calls: mask a batch's rows before sampling, mask drafts before verification,
               advance the matchers by the emitted tokens and append forced ones (jump-forward)

At the core floor: it knows sequences, never the model or the runner.
"""
