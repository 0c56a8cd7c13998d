"""Prometheus text scraping: counters before and after a phase, and their deltas.

Counter names differ between servers (ours, vLLM's `vllm:` family, llama.cpp's `llamacpp:`), so nothing
here knows a specific name: every counter sample and every histogram/summary _sum and _count is diffed,
and the lever-relevant ones are picked out by name (prefix cache; speculative decoding / drafts /
acceptance; a mixture-of-experts model's expert reads). A server without /metrics gives None everywhere, never
an error.
"""

from __future__ import annotations

import math
import re

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
HIGHLIGHT_PATTERNS = {
    "prefix_cache": re.compile(r"prefix[_-]?cache", re.I),
    "spec_decode": re.compile(r"spec[_-]?decod|draft|accept", re.I),
    "moe": re.compile(r"moe_", re.I),  # LeverLab's leverlab_engine_moe_*_total (models/expert_reads.py)
}


def parse(text: str) -> dict[str, float]:
    """Cumulative samples only: `name{labels}` -> value for counters and histogram/summary sums/counts."""
    types: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# TYPE"):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, raw = m.group(1), m.group(2) or "", m.group(3)
        try:
            value = float(raw)
        except ValueError:
            continue
        if name.endswith("_created") or name.endswith("_bucket"):
            continue
        family = _family(name, types)
        kind = types.get(family)
        cumulative = (
            kind == "counter"
            or (kind in ("histogram", "summary") and (name.endswith("_sum") or name.endswith("_count")))
            or (kind is None and name.endswith("_total"))
        )
        if cumulative and not math.isnan(value):
            out[name + labels] = value
    return out


def _family(name: str, types: dict[str, str]) -> str:
    if name in types:
        return name
    for suffix in ("_total", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in types:
            return name[: -len(suffix)]
    return name


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        resp = await client.get(url, timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200 or "text/html" in resp.headers.get("content-type", ""):
        return None
    samples = parse(resp.text)
    return samples or None


def deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """after - before for every sample in `after` (a sample new in `after` started at 0); only non-zero."""
    if before is None or after is None:
        return None
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in sorted(d.items()) if v != 0}


def _sum_matching(d: dict[str, float], *needles: str) -> float | None:
    names = {k: k.split("{")[0].lower() for k in d}
    # per-position acceptance counters would count the same tokens twice
    hits = [v for k, v in d.items() if all(n in names[k] for n in needles) and "per_pos" not in names[k]]
    return sum(hits) if hits else None


def highlights(d: dict[str, float] | None) -> dict | None:
    """The lever-relevant deltas by name, plus the ratios that can be derived generically."""
    if not d:
        return None
    out: dict = {}
    for key, pat in HIGHLIGHT_PATTERNS.items():
        picked = {k: v for k, v in d.items() if pat.search(k.split("{")[0])}
        if picked:
            out[key] = picked
    pc = out.get("prefix_cache")
    if pc:
        hits, queries = _sum_matching(pc, "hit"), _sum_matching(pc, "quer")
        if hits is not None and queries:
            out["prefix_cache_hit_rate"] = hits / queries
    sd = out.get("spec_decode")
    if sd:
        accepted = _sum_matching(sd, "accepted_tokens") or _sum_matching(sd, "accept")
        drafted = _sum_matching(sd, "draft_tokens")
        if accepted is not None and drafted:
            out["draft_acceptance_rate"] = accepted / drafted
    per_pass = moe_bytes_per_pass(d)
    if per_pass is not None:
        out["moe_weight_bytes_per_pass"] = per_pass
    return out or None


def moe_bytes_per_pass(d: dict[str, float] | None) -> float | None:
    """Weight bytes per decode pass that a mixture-of-experts model's server counted from its router's choices
    (weight bytes read / decode passes), or None where it reports none."""
    if not d:
        return None
    read = sum(v for k, v in d.items() if k.split("{")[0].endswith("moe_weight_bytes_read_total"))
    passes = sum(v for k, v in d.items() if k.split("{")[0].endswith("moe_decode_passes_total"))
    return read / passes if read and passes else None
