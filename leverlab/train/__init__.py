"""Training of the bundled default model family (issue 3): corpus, tokenizer, target, draft, prompt set, cards.

Everything here reproduces `models/leverlab-code-15m`, `models/leverlab-code-draft` and `models/workload.json`
from the running interpreter's standard library source; no network, no downloaded weights or data.

A tool on the public API: may import leverlab.LLM and the model code it trains (models, layers, speculative's
EAGLE formats) and the plain types.
"""
