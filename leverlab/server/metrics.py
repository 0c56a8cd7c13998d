"""Prometheus metrics: per-request histograms observed when a request finishes, engine gauges read at scrape.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `leverlab_time_to_first_token_seconds`) so
dashboards carry over. Each app has its own registry, so several servers can live in one test process.

Engine stats are read from `engine.stats()` at scrape time, by attribute name, tolerating absent ones:
    num_running, num_waiting                    requests
    kv_blocks_total, kv_blocks_free             KV blocks (free = allocatable now, evictable cached ones included)
    kv_blocks_cached                            the free blocks that still hold reusable prefix-cache KV
    (AsyncLLM's EngineStats names them num_total_blocks, num_free_blocks, num_cached_blocks: both are read.)
    Blocks held by requests: used = total - free; all KV blocks are free again when used == 0.
    kv_cache_usage                              0..1; computed from the blocks when absent
    counters: dict[str, float]                  monotonic counters the levers add, exported as
                                                leverlab_engine_<name>_total (prefix_cache_queries, prefix_cache_hits,
                                                spec_draft_tokens, spec_accepted_tokens, preemptions, ...)
                                                mixture of experts: moe_decode_passes, moe_experts_read,
                                                moe_weight_bytes_read (COUNTER_HELP; models/expert_reads.py)
    replicas                                    data parallelism: [(index, alive, stats)], exported per replica as
                                                leverlab_replica_*{replica="i"} (the unlabelled samples are sums)
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from leverlab.outputs import RequestOutput

log = logging.getLogger("leverlab.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM uses them: TTFT and ITL reach down to milliseconds, e2e up to minutes.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
PHASES = ("tokenize", "queue", "prefill", "decode", "detokenize")

# Help texts of the engine counters whose meaning the name alone does not carry (others: "Engine counter <name>.").
# Mixture of experts: weight bytes per decode pass = moe_weight_bytes_read / moe_decode_passes (rate over rate).
COUNTER_HELP = {
    "moe_decode_passes": "Decode passes (every token sampled: decode, verification) of a mixture-of-experts model "
                         "whose routed experts were counted.",
    "moe_experts_read": "Distinct routed experts those decode passes read, summed over sparse layers and passes "
                        "(an expert several sequences chose counts once per pass).",
    "moe_weight_bytes_read": "Weight bytes those decode passes read: attention, norms, routers, shared experts and "
                             "head, plus each hit expert at its quantized layout.",
    "moe_decode_passes_uncounted": "Decode passes left out of the expert counts (some sparse layer ran where the "
                                   "router's choices could not be seen).",
}


class _EngineCollector(Collector):
    """Gauges and engine-side counters, read from engine.stats() on every scrape."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        try:
            st = self.engine.stats()
        except Exception as e:  # a scrape must never fail the server
            log.warning("engine.stats() failed: %s", e)
            return
        g = lambda name, doc, value: _gauge(name, doc, value)  # noqa: E731
        yield from g(
            "leverlab_num_requests_running", "Requests in the running batch.", _get(st, "num_running")
        )
        yield from g(
            "leverlab_num_requests_waiting", "Requests waiting to be scheduled.", _get(st, "num_waiting")
        )
        total, free = (
            _get(st, "kv_blocks_total", "num_total_blocks"),
            _get(st, "kv_blocks_free", "num_free_blocks"),
        )
        cached = _get(st, "kv_blocks_cached", "num_cached_blocks")
        yield from g("leverlab_kv_blocks_total", "KV cache blocks in all.", total)
        yield from g(
            "leverlab_kv_blocks_free",
            "KV cache blocks free to allocate (evictable cached ones included).",
            free,
        )
        yield from g(
            "leverlab_kv_blocks_cached",
            "Free KV cache blocks that still hold reusable prefix-cache KV.",
            cached,
        )
        used = total - free if total is not None and free is not None else None
        yield from g("leverlab_kv_blocks_used", "KV cache blocks held by requests.", used)
        usage = _get(st, "kv_cache_usage", "kv_usage")
        if usage is None and used is not None and total:
            usage = used / total
        yield from g("leverlab_kv_cache_usage_perc", "KV cache usage, 0..1 (blocks held by requests).", usage)
        for name, value in sorted((_get(st, "counters") or {}).items()):
            metric = "leverlab_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", str(name)).removesuffix("_total")
            c = CounterMetricFamily(metric, COUNTER_HELP.get(name, f"Engine counter {name}."))
            c.add_metric([], float(value))
            yield c
        yield from _per_replica(_get(st, "replicas"))


def _per_replica(replicas: Any):
    """Data parallelism: the same gauges and counters for each replica, labelled replica="i" (the unlabelled
    ones above are their sums), and whether it is up. A dead replica keeps its last counters."""
    if not replicas:
        return
    up = GaugeMetricFamily("leverlab_replica_up", "1 while the data-parallel replica serves, 0 once it died.",
                           labels=["replica"])
    gauges = {name: GaugeMetricFamily(f"leverlab_replica_{name}", f"{name}, per data-parallel replica.",
                                      labels=["replica"])
              for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_total", "kv_blocks_used")}
    counters: dict[str, CounterMetricFamily] = {}
    for index, alive, st in replicas:
        label = [str(index)]
        up.add_metric(label, 1.0 if alive else 0.0)
        if st is None:
            continue
        if alive:
            total, free = _get(st, "kv_blocks_total", "num_total_blocks"), _get(st, "kv_blocks_free", "num_free_blocks")
            for name, value in (("num_requests_running", _get(st, "num_running")),
                                ("num_requests_waiting", _get(st, "num_waiting")), ("kv_blocks_total", total),
                                ("kv_blocks_used", total - free if total is not None and free is not None else None)):
                if value is not None:
                    gauges[name].add_metric(label, float(value))
        for name, value in sorted((_get(st, "counters") or {}).items()):
            metric = "leverlab_replica_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", str(name)).removesuffix("_total")
            if metric not in counters:
                counters[metric] = CounterMetricFamily(metric, f"Engine counter {name}, per replica.",
                                                       labels=["replica"])
            counters[metric].add_metric(label, float(value))
    yield up
    yield from gauges.values()
    yield from counters.values()


def _get(st: Any, *names: str) -> Any:
    """The first of `names` that the stats object (or dict) has and is not None."""
    for name in names:
        v = st.get(name) if isinstance(st, dict) else getattr(st, name, None)
        if v is not None:
            return v
    return None


def _gauge(name: str, doc: str, value: Any):
    if value is None:
        return
    m = GaugeMetricFamily(name, doc)
    m.add_metric([], float(value))
    yield m


# vLLM's names for our core metrics, so that dashboards built for vLLM read a LeverLab server unchanged.
# (vLLM's own label `model_name` is added.) Both of vLLM's names are given where it renamed one.
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:time_per_output_token_seconds": "itl",
    "vllm:e2e_request_latency_seconds": "e2e",
}
VLLM_GAUGES = {  # alias -> our engine gauge
    "vllm:num_requests_running": "leverlab_num_requests_running",
    "vllm:num_requests_waiting": "leverlab_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "leverlab_kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "leverlab_kv_cache_usage_perc",
}
VLLM_COUNTERS = {  # alias -> our engine counter (prefix-cache ones in tokens, as vLLM counts them)
    "vllm:prefix_cache_queries": "leverlab_engine_prefix_cache_queries",
    "vllm:prefix_cache_hits": "leverlab_engine_prefix_cache_hits",
    "vllm:prompt_tokens": "leverlab_engine_prompt_tokens",
    "vllm:generation_tokens": "leverlab_engine_generation_tokens",
}


class _VllmAliases(Collector):
    """The `vllm:` names: the same samples as ours, renamed, labelled with model_name."""

    def __init__(self, metrics: ServerMetrics, engine_collector: _EngineCollector, model_name: str):
        self.metrics, self.engine_collector, self.model = metrics, engine_collector, model_name

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily

        for alias, attr in VLLM_HISTOGRAMS.items():
            (fam,) = getattr(self.metrics, attr).collect()
            buckets, total = [], 0.0
            for smp in fam.samples:
                if smp.name.endswith("_bucket"):
                    buckets.append((smp.labels["le"], smp.value))
                elif smp.name.endswith("_sum"):
                    total = smp.value
            h = HistogramMetricFamily(alias, f"{fam.documentation} (vLLM's name)", labels=["model_name"])
            h.add_metric([self.model], buckets, total)
            yield h
        ours = {fam.name: fam for fam in self.engine_collector.collect()}
        for alias, name in VLLM_GAUGES.items():
            if name in ours:
                g = GaugeMetricFamily(alias, f"{ours[name].documentation} (vLLM's name)", labels=["model_name"])
                g.add_metric([self.model], ours[name].samples[0].value)
                yield g
        for alias, name in VLLM_COUNTERS.items():
            if name in ours:
                c = CounterMetricFamily(alias, f"{ours[name].documentation} (vLLM's name)", labels=["model_name"])
                c.add_metric([self.model], ours[name].samples[0].value)
                yield c


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str):
        disable_created_metrics()  # the *_created samples only add noise to every scrape
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "leverlab_time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "leverlab_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "leverlab_e2e_request_latency_seconds",
            "Arrival to finish, per request.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.phase = {
            p: Histogram(
                f"leverlab_request_{p}_time_seconds",
                f"Time spent in {p}, per request.",
                buckets=E2E_BUCKETS if p in ("decode", "queue") else TTFT_BUCKETS,
                registry=r,
            )
            for p in PHASES
        }
        self.prompt_tokens = Counter("leverlab_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("leverlab_generation_tokens", "Tokens generated.", registry=r)
        self.cached_prompt_tokens = Counter(
            "leverlab_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.finished = Counter(
            "leverlab_request_success", "Finished requests, by finish reason.", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "leverlab_requests_rejected", "Requests refused, by reason.", ["reason"], registry=r
        )
        self.aborted = Counter(
            "leverlab_requests_aborted",
            "Requests that ended unfinished: the client went away, or the engine failed mid-stream.",
            registry=r,
        )
        self.http = Counter(
            "leverlab_http_requests",
            "HTTP requests answered, by route and status.",
            ["path", "status"],
            registry=r,
        )
        self.info = Gauge(
            "leverlab_model_info", "The served model (value is always 1).", ["model"], registry=r
        )
        self.info.labels(model=model_name).set(1)
        engine_collector = _EngineCollector(engine)
        r.register(engine_collector)
        r.register(_VllmAliases(self, engine_collector, model_name))

    def observe_finished(self, out: RequestOutput, server_tokenize_s: float = 0.0) -> None:
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        times = m.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(max(0.0, b - a))
        end = m.finished_time or m.last_token_time
        if end is not None:
            self.e2e.observe(max(0.0, end - m.arrival_time))
        t = m.timings()
        t["tokenize_ms"] += 1e3 * server_tokenize_s
        for p in PHASES:
            self.phase[p].observe(max(0.0, t[f"{p}_ms"] / 1e3))
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cached_prompt_tokens.inc(m.num_cached_prompt_tokens)
        for c in out.outputs:
            self.generation_tokens.inc(len(c.token_ids))
            self.finished.labels(finish_reason=str(c.finish_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
