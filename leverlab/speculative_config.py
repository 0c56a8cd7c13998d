"""--speculative-config, in the JSON shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, fields

from leverlab.errors import UnsupportedLever

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Both load any EAGLE head folder we read: ours, `speculators` eagle3, the original EAGLE-3 release.
EAGLE_METHODS = ("eagle", "eagle3")
DRAFT_QUANTIZATION = ("auto", "none", "int8")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 3
    model: str | None = None  # draft model folder (draft_model) or head folder (eagle), or a Hub id of one
    revision: str | None = None  # the Hub id's branch, tag or commit (vLLM's key)
    prompt_lookup_min: int = 2  # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4  # ngram: longest suffix to look up
    disable_by_batch_size: int | None = None  # no speculation while more sequences than this are running
    adaptive: bool = False  # choose K per step (0 included) from measured acceptance and batch size
    # The draft's (or head's) own parallel degree, never forced to the target's. Only 1 is built: the draft
    # model and the EAGLE head run in the engine's process; other values are refused, never ignored.
    draft_tensor_parallel_size: int = 1
    # The draft's weights as it drafts (vLLM's key): "auto" quantizes an EAGLE head's linears and the head it
    # drafts through to int8 where our int8 kernels serve (CPU, bf16/fp16; drafts only propose, so the output
    # does not change) and gives a draft model the target's --quantization; "none" keeps the model dtype (null
    # too); "int8" asks for int8.
    quantization: str | None = "auto"

    @classmethod
    def from_dict(cls, raw: dict) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise UnsupportedLever(f"--speculative-config must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UnsupportedLever(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
        method = raw.get("method")
        if method is None and raw.get("model"):
            method = "draft_model"
        cfg = cls(**{**raw, "method": method})
        if cfg.method not in METHODS:
            raise UnsupportedLever(f"--speculative-config method {cfg.method!r} is not one of {list(METHODS)}")
        if cfg.method in ("draft_model", *EAGLE_METHODS) and not cfg.model:
            what = "the head folder (leverlab train-eagle)" if cfg.method in EAGLE_METHODS else "the draft model folder"
            raise UnsupportedLever(f'speculative method "{cfg.method}" needs "model": {what}')
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise UnsupportedLever("num_speculative_tokens must be in [1, 16]")
        if cfg.draft_tensor_parallel_size not in (None, 1):
            raise UnsupportedLever(
                f"draft_tensor_parallel_size {cfg.draft_tensor_parallel_size} is not supported: the draft model or "
                "EAGLE head runs unsharded (degree 1) in the engine's process, whatever the target's "
                "--tensor-parallel-size; set it to 1 or leave it out")
        cfg.quantization = "none" if cfg.quantization is None else cfg.quantization
        if cfg.quantization not in DRAFT_QUANTIZATION:
            raise UnsupportedLever(f"--speculative-config quantization {cfg.quantization!r} is not one of "
                                   f"{list(DRAFT_QUANTIZATION)} (the draft's or the EAGLE head's weights)")
        if cfg.method == "ngram" and cfg.quantization == "int8":
            raise UnsupportedLever('speculative method "ngram" has no weights to quantize: leave "quantization" out')
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise UnsupportedLever("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg
