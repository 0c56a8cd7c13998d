"""LeverLab: an LLM inference engine with every latency lever built in, and the lab that measures them."""

__version__ = "0.1.0"
