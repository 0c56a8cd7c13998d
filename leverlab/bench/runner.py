"""run_benchmark(config) -> BenchResult: discover the server, build the workload, warm up, run each phase,
aggregate. Phases, in order:
  single:  every bucket at concurrency 1 (single-request latency, never mixed with batching);
  sweep:   the sweep bucket at each concurrency level (closed loop), or
  poisson: the sweep bucket at each request rate (open loop) when request rates are given.
Each phase is one group in the results; Prometheus counters are diffed around each phase.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from leverlab.bench import metrics, prometheus, strategies
from leverlab.bench.agent import BUCKET as AGENT_BUCKET
from leverlab.bench.agent import agent_requests
from leverlab.bench.client import build_payload, send_request
from leverlab.bench.config import BenchConfig, BenchResult
from leverlab.bench.manifest import git_info, harness_versions, machine_info, now_iso
from leverlab.bench.records import BenchRequest, RequestRecord
from leverlab.bench.workloads import (
    Workload,
    default_workload_path,
    load_buckets,
    load_sharegpt,
    load_tokenizer,
    shared_prefix,
    synthetic,
)


class BenchError(RuntimeError):
    pass


@dataclass(slots=True)
class Phase:
    name: str  # the group's name: "single/<bucket>", "sweep/<bucket>/c<c>", "poisson/<bucket>/r<rate>"
    kind: str
    bucket: str
    requests: list[BenchRequest]
    concurrency: int | None = None
    rate: float | None = None
    # The name of an earlier phase that sends exactly these requests the same way: its records are this one's
    # (the sweep's concurrency-1 point over the single phase's bucket; running it again measured nothing new)
    same_as: str | None = None


class Progress:
    """Hooks for a live display; the default does nothing (library use, tests)."""

    def start(self, phases: list[Phase], warmup: int) -> None: ...
    def phase(self, name: str, total: int) -> None: ...
    def request_done(self, rec: RequestRecord) -> None: ...
    def phase_done(self, group: dict[str, Any]) -> None: ...
    def stop(self) -> None: ...


def server_root(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /metrics and /version live)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def local_tokenizer_dir(models: Any, model: str | None) -> str | None:
    """The served model's folder when /v1/models names a local one with a tokenizer (vLLM and our server
    report it as `root`): the served model's own tokenizer, used when --tokenizer is not given."""
    try:
        entries = [m for m in models["data"] if model is None or m.get("id") == model] or models["data"]
        root = entries[0].get("root")
    except (TypeError, KeyError, IndexError, AttributeError):
        return None
    if (
        root
        and Path(root).is_dir()
        and any((Path(root) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    ):
        return str(root)
    return None


def build_workload(cfg: BenchConfig, tokenizer_path: str | None = None) -> Workload:
    """tokenizer_path: cfg.tokenizer, else the served model's local folder (see local_tokenizer_dir)."""
    tokenizer_path = cfg.tokenizer or tokenizer_path
    needs = (
        cfg.workload == "sharegpt"
        or (cfg.tokenizer is not None)
        or (cfg.workload in ("synthetic", "shared-prefix") and tokenizer_path is not None)
    )
    tok = load_tokenizer(tokenizer_path) if needs else None
    wl = _build(cfg, tok)
    wl.description["tokenizer"] = tokenizer_path if tok is not None else None
    return wl


def _build(cfg: BenchConfig, tok) -> Workload:
    if cfg.workload == "agent":  # tool calls and JSON-schema answers from the prompt set's chat turns
        reqs = agent_requests(Path(cfg.workload_file or default_workload_path()), cfg.num_prompts, cfg.seed)
        return Workload("agent", {AGENT_BUCKET: reqs}, {"kind": "agent", "requests": len(reqs)})
    if cfg.workload == "buckets":
        return load_buckets(
            cfg.workload_file,
            buckets=cfg.buckets,
            num_prompts=cfg.num_prompts,
            seed=cfg.seed,
            output_len=cfg.output_len,
        )
    if cfg.workload == "sharegpt":
        return load_sharegpt(
            cfg.dataset,
            tok,
            buckets=cfg.buckets,
            num_prompts=cfg.num_prompts or 16,
            seed=cfg.seed,
            output_len=cfg.output_len,
            decode_output_len=cfg.output_len or cfg.decode_output_len,
        )
    if cfg.workload == "synthetic":
        return synthetic(
            input_len=cfg.input_len,
            output_len=cfg.output_len or 256,
            num_prompts=cfg.num_prompts or 16,
            seed=cfg.seed,
            range_ratio=cfg.range_ratio,
            tokenizer=tok,
        )
    return shared_prefix(
        prefix_len=cfg.prefix_len,
        suffix_len=cfg.suffix_len,
        output_len=cfg.output_len or 128,
        num_prompts=cfg.num_prompts or 16,
        seed=cfg.seed,
        tokenizer=tok,
    )


def _cycle(reqs: list[BenchRequest], n: int) -> list[BenchRequest]:
    out = []
    for i in range(n):
        r = reqs[i % len(reqs)]
        k = i // len(reqs)
        out.append(
            r
            if k == 0
            else BenchRequest(
                id=f"{r.id}#r{k}",
                bucket=r.bucket,
                output_len=r.output_len,
                prompt=r.prompt,
                messages=r.messages,
                prompt_tokens=r.prompt_tokens,
                source=r.source,
                body=r.body,
            )
        )
    return out


def plan_phases(cfg: BenchConfig, wl: Workload) -> list[Phase]:
    phases: list[Phase] = []
    if cfg.single:
        for bucket, reqs in wl.buckets.items():
            phases.append(Phase(f"single/{bucket}", "single", bucket, list(reqs), concurrency=1))
    sweep_bucket = cfg.sweep_bucket or ("medium" if "medium" in wl.buckets else next(iter(wl.buckets)))
    if sweep_bucket not in wl.buckets:
        raise BenchError(f"sweep bucket {sweep_bucket!r} not in the workload; it has {', '.join(wl.buckets)}")
    base = wl.buckets[sweep_bucket]
    if cfg.request_rates:
        for rate in cfg.request_rates:
            phases.append(
                Phase(
                    f"poisson/{sweep_bucket}/r{rate:g}",
                    "poisson",
                    sweep_bucket,
                    _cycle(base, len(base)),
                    concurrency=cfg.max_concurrency,
                    rate=rate,
                )
            )
    else:
        for c in cfg.concurrency:
            n = max(len(base), cfg.sweep_rounds * c)
            same = f"single/{sweep_bucket}" if cfg.single and c == 1 and n == len(base) else None
            phases.append(
                Phase(f"sweep/{sweep_bucket}/c{c}", "sweep", sweep_bucket, _cycle(base, n), concurrency=c,
                      same_as=same)
            )
    return phases


async def _get_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Any | None:
    try:
        r = await client.get(url, headers=headers, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def arun_benchmark(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    progress = progress or Progress()
    base = cfg.base_url.rstrip("/")
    root = server_root(base)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    url = f"{base}/chat/completions" if cfg.endpoint == "chat" else f"{base}/completions"
    # Ask the server first: fail fast when it is down, and find the served model's tokenizer.
    async with httpx.AsyncClient(timeout=10.0) as probe:
        models = await _get_json(probe, f"{base}/models", headers)
        version = await _get_json(probe, f"{root}/version", headers)
    model = cfg.model
    if model is None:
        try:
            model = models["data"][0]["id"]
        except (TypeError, KeyError, IndexError):
            raise BenchError(
                f"could not list models at {base}/models (is the server up?); pass --model"
            ) from None
    wl = build_workload(cfg, local_tokenizer_dir(models, model))
    phases = plan_phases(cfg, wl)
    max_c = max([p.concurrency or 1 for p in phases] + [1])
    # Open-loop (Poisson) without a cap: no pool limit, or waiting for a connection would hide in TTFT.
    uncapped = bool(cfg.request_rates) and not cfg.max_concurrency
    limits = httpx.Limits(
        max_connections=None if uncapped else max_c + 8, max_keepalive_connections=max_c + 8
    )
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    started = now_iso()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        def sender(group: str, concurrency: int | None = None, rate: float | None = None) -> strategies.Send:
            async def send(req: BenchRequest) -> RequestRecord:
                payload = build_payload(
                    req,
                    model=model,
                    endpoint=cfg.endpoint,
                    temperature=cfg.temperature,
                    ignore_eos=cfg.ignore_eos,
                    min_tokens=cfg.min_tokens,
                    extra_body=cfg.extra_body,
                )
                rec = await send_request(
                    client, url, req, payload, group=group, endpoint=cfg.endpoint, t0=t0, headers=headers
                )
                rec.concurrency, rec.request_rate = concurrency, rate
                progress.request_done(rec)
                return rec

            return send

        async def run_phase(ph: Phase) -> tuple[list[RequestRecord], float, Any, Any]:
            """Its records, its duration, and the server's metrics before and after."""
            before = await prometheus.scrape(client, f"{root}/metrics") if cfg.scrape_metrics else None
            send = sender(ph.name, ph.concurrency, ph.rate)
            if ph.kind == "poisson":
                recs, dur = await strategies.poisson(
                    ph.requests, ph.rate, send, seed=cfg.seed, max_concurrency=ph.concurrency
                )
            elif ph.kind == "sweep" and cfg.batching == "static":
                recs, dur = await strategies.static_batches(ph.requests, ph.concurrency or 1, send)
            else:
                recs, dur = await strategies.concurrent(ph.requests, ph.concurrency or 1, send)
            after = await prometheus.scrape(client, f"{root}/metrics") if cfg.scrape_metrics else None
            return recs, dur, before, after

        records: list[RequestRecord] = []
        groups: list[dict[str, Any]] = []
        progress.start(phases, cfg.warmup)
        try:
            if cfg.warmup:
                progress.phase("warmup", cfg.warmup)
                first = phases[0].requests if phases else []
                records += await strategies.warmup(
                    first, cfg.warmup, sender("warmup", None), concurrency=max_c
                )
            run_before = await prometheus.scrape(client, f"{root}/metrics") if cfg.scrape_metrics else None
            ran: dict[str, tuple[list[RequestRecord], float, Any, Any]] = {}
            for ph in phases:
                progress.phase(ph.name, len(ph.requests))
                reused = ph.same_as if ph.same_as in ran else None
                if reused:
                    recs, dur, before, after = ran[reused]
                    recs = [replace(r, group=ph.name, concurrency=ph.concurrency) for r in recs]
                else:
                    recs, dur, before, after = await run_phase(ph)
                ran[ph.name] = (recs, dur, before, after)
                records += recs
                g = {
                    "name": ph.name,
                    "kind": ph.kind,
                    "bucket": ph.bucket,
                    "concurrency": ph.concurrency,
                    "request_rate": ph.rate,
                    "same_requests_as": reused,
                    **metrics.aggregate(
                        recs,
                        dur,
                        slo_ttft_ms=cfg.slo_ttft_ms,
                        slo_tpot_ms=cfg.slo_tpot_ms,
                        slo_e2e_ms=cfg.slo_e2e_ms,
                    ),
                }
                d = prometheus.deltas(before, after)
                g["prometheus"] = (
                    {"deltas": d, "highlights": prometheus.highlights(d)} if d is not None else None
                )
                groups.append(g)
                progress.phase_done(g)
            run_after = await prometheus.scrape(client, f"{root}/metrics") if cfg.scrape_metrics else None
        finally:
            progress.stop()
    run_d = prometheus.deltas(run_before, run_after)
    manifest = {
        "harness": harness_versions(),
        "started": started,
        "finished": now_iso(),
        "server": {
            "base_url": base,
            "model": model,
            "endpoint": cfg.endpoint,
            "models": [m.get("id") for m in (models or {}).get("data", [])]
            if isinstance(models, dict)
            else None,
            "version": version,
            "metrics_available": run_before is not None,
        },
        "git": git_info(),
        "machine": machine_info(),
        "seed": cfg.seed,
        "workload": wl.description,
        "phases": [
            {
                "name": p.name,
                "kind": p.kind,
                "bucket": p.bucket,
                "requests": len(p.requests),
                "concurrency": p.concurrency,
                "request_rate": p.rate,
                "same_requests_as": p.same_as,
            }
            for p in phases
        ],
        "config": cfg.to_json(),
        "definitions": "docs/bench.md (TTFT, ITL, TPOT, E2E as `vllm bench serve`; TM95 drops floor(0.05*n))",
    }
    result = BenchResult(
        config=cfg,
        manifest=manifest,
        groups=groups,
        records=records,
        prometheus={"deltas": run_d, "highlights": prometheus.highlights(run_d)}
        if run_d is not None
        else None,
    )
    if cfg.out_dir:
        from leverlab.bench.report import write_results  # matplotlib: only when writing

        write_results(result, Path(cfg.out_dir))
    return result


def run_benchmark(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Synchronous entry point (for `leverlab study` and scripts); see arun_benchmark inside a loop."""
    return asyncio.run(arun_benchmark(cfg, progress))
