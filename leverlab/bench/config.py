"""BenchConfig (what to run) and BenchResult (what came back): the harness's Python face.

`leverlab bench` maps its flags onto BenchConfig; `leverlab study` builds one directly and calls
leverlab.bench.run_benchmark(config).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from leverlab.bench.records import RequestRecord

WORKLOADS = ("buckets", "sharegpt", "synthetic", "shared-prefix", "agent")
ENDPOINTS = ("completions", "chat")


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    endpoint: str = "completions"
    workload: str = "buckets"
    workload_file: str | None = None  # buckets workload; None: the bundled models/workload.json
    buckets: list[str] | None = None  # None: every bucket the workload has
    dataset: str | None = None  # ShareGPT JSON
    tokenizer: str | None = None  # local tokenizer folder (sharegpt; synthetic/shared-prefix exact lengths)
    num_prompts: int | None = None  # per bucket; None: all of a prompt-set bucket, 16 for generated ones
    output_len: int | None = None  # override every bucket's output length
    decode_output_len: int = 1024  # sharegpt's decode bucket
    input_len: int = 512  # synthetic
    range_ratio: float = 0.0  # synthetic: 0 = fixed length
    prefix_len: int = 1024  # shared-prefix
    suffix_len: int = 32  # shared-prefix
    single: bool = True  # the concurrency-1 pass over every bucket
    sweep_bucket: str | None = None  # None: "medium" if present, else the first bucket
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    sweep_rounds: int = 4  # requests per sweep level: max(bucket size, sweep_rounds * c)
    request_rates: list[float] = field(default_factory=list)  # Poisson mode; replaces the sweep when given
    max_concurrency: int | None = None  # cap in flight under Poisson
    batching: str = "continuous"  # sweep levels: "static" sends waves of c (strategies.static_batches)
    warmup: int = 2
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    min_tokens: bool = False  # also send min_tokens = output length
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    timeout_s: float = 600.0  # per request
    extra_body: dict[str, Any] | None = None
    scrape_metrics: bool = True
    out_dir: str | None = None  # None: nothing written by run_benchmark (the CLI picks results/<timestamp>)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose from {', '.join(ENDPOINTS)}")
        if self.workload == "agent" and self.endpoint != "chat":
            raise ValueError("the agent workload is chat turns (tools, response_format): use --endpoint chat")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency levels must be >= 1")
        if any(r <= 0 for r in self.request_rates):
            raise ValueError("request rates must be > 0")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching is continuous or static, got {self.batching!r}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError("output_len must be >= 1")
        if self.workload == "sharegpt" and not self.dataset:
            raise ValueError("the sharegpt workload needs a dataset path (--dataset)")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d.get("api_key"):
            d["api_key"] = "<redacted>"
        return d


@dataclass
class BenchResult:
    config: BenchConfig
    manifest: dict[str, Any]
    groups: list[dict[str, Any]]  # one per (bucket, concurrency | rate): see metrics.aggregate
    records: list[RequestRecord]  # every request, warm-up included (group "warmup")
    prometheus: dict[str, Any] | None = None  # whole-run counter deltas and highlights
    out_dir: Path | None = None

    def group(self, name: str) -> dict[str, Any]:
        for g in self.groups:
            if g["name"] == name:
                return g
        raise KeyError(f"no group {name!r}; have {[g['name'] for g in self.groups]}")

    def summary_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "groups": self.groups, "prometheus": self.prometheus}
