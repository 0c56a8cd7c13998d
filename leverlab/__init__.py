"""LeverLab: an LLM inference engine with every latency lever built in, and the lab that measures them."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import leverlab` (e.g. for the bench CLI) must not pay for torch.
    if name == "LLM":
        from leverlab.llm import LLM

        return LLM
    if name == "SamplingParams":
        from leverlab.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from leverlab.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
