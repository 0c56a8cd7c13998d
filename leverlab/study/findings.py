"""The reference study's findings, checked against this study's own numbers.

Each check returns {id, title, status, evidence, why}: status is "reproduced", "partly", "not reproduced"
or "not tested"; evidence quotes the measured numbers; why says what the numbers mean or why a check could
not run (a configuration refused by the engine, a bucket missing). Thresholds are stated in each check.
"""

from __future__ import annotations

from typing import Any

from leverlab.study.findings_common import (
    MARGIN,
    NOT_REPRODUCED,
    NOT_TESTED,
    OUTPUT_VS_INPUT_MIN,
    PARTLY,
    REPRODUCED,
    by_name,
    finding,
    metrics_of,
    ran_step,
    unavailable,
)
from leverlab.study.findings_spec import check_exactness, check_ngram, check_separate_draft


def check_output_length(a: dict[str, Any]) -> dict[str, str]:
    title = "Output length, not input length, drives latency (decode is memory-bound)"
    base = a["configs"][0]
    single = metrics_of(base).get("single") or {}
    short, long_, decode = (
        single.get("short"),
        single.get("long") or single.get("medium"),
        single.get("decode"),
    )
    if not (short and long_ and decode):
        return finding(
            "1", title, NOT_TESTED, "", "needs the baseline's short, long (or medium) and decode buckets"
        )
    d_in = (long_["input_tokens"] or 0) - (short["input_tokens"] or 0)
    d_out = (decode["output_tokens"] or 0) - (short["output_tokens"] or 0)
    if d_in <= 0 or d_out <= 0:
        return finding("1", title, NOT_TESTED, "", "the buckets do not differ in input and output length")
    per_in = (long_["e2e_p50_s"] - short["e2e_p50_s"]) / d_in
    per_out = (decode["e2e_p50_s"] - short["e2e_p50_s"]) / d_out
    evidence = (
        f"baseline P50: {short['input_tokens']:.0f} -> {long_['input_tokens']:.0f} input tokens "
        f"{short['e2e_p50_s']:.2f} -> {long_['e2e_p50_s']:.2f} s ({per_in * 1e3:+.2f} ms per input token); "
        f"{short['output_tokens']:.0f} -> {decode['output_tokens']:.0f} output tokens "
        f"{short['e2e_p50_s']:.2f} -> {decode['e2e_p50_s']:.2f} s ({per_out * 1e3:+.2f} ms per output token)"
    )
    ratio = per_out / per_in if per_in > 0 else float("inf")
    if per_out > 0 and ratio >= OUTPUT_VS_INPUT_MIN:
        why = (
            f"an output token costs {ratio:.0f}x an input token"
            if per_in > 0
            else "extra input cost nothing measurable"
        ) + ": prefill processes the prompt in parallel passes, decode pays one full weight read per token"
        return finding("1", title, REPRODUCED, evidence, why)
    why = f"an output token costs only {ratio:.1f}x an input token here"
    t_s, t_l = short.get("ttft_p50_ms"), long_.get("ttft_p50_ms")
    extra = long_["e2e_p50_s"] - short["e2e_p50_s"]
    if t_s is not None and t_l is not None and extra > 0:
        prefill = (t_l - t_s) / 1e3
        why += (
            f": of the {extra:.2f} s the longer prompt added, {prefill:.2f} s is prefill (TTFT; a CPU has no "
            f"massively parallel cores to make prefill nearly free) and {extra - prefill:.2f} s is slower decode "
            "over the longer context (each step reads the whole KV cache)"
        )
    else:
        why += ": on a CPU prefill is compute-bound, so long prompts are not nearly free as on a GPU"
    return finding("1", title, NOT_REPRODUCED if ratio < 2 else PARTLY, evidence, why)


def _precision_steps(a: dict[str, Any]) -> list[tuple[dict, dict]]:
    byn = by_name(a)
    return [(byn[c["parent"]], c) for c in a["configs"] if c["lever"] == "precision" and c["parent"] in byn]


def check_precision(a: dict[str, Any]) -> dict[str, str]:
    title = "Precision speedups track the byte ratio"
    pairs = _precision_steps(a)
    if not pairs:
        return finding("2", title, NOT_TESTED, "", "the plan has no precision step")
    done = [(p, c) for p, c in pairs if p["status"] == "done" and c["status"] == "done"]
    skipped = [unavailable(c) for p, c in pairs if c["status"] != "done"]
    if not done:
        return finding("2", title, NOT_TESTED, "", "; ".join(skipped) or "no precision step ran")
    parts, shares, faster = [], [], True
    for p, c in done:
        pb, cb = (
            (p.get("prediction") or {}).get("bytes_per_pass"),
            (c.get("prediction") or {}).get("bytes_per_pass"),
        )
        byte_ratio = pb / cb if pb and cb else None
        d_p, d_c = metrics_of(p).get("decode_tok_s"), metrics_of(c).get("decode_tok_s")
        r_p, r_c = metrics_of(p).get("rps_cmax"), metrics_of(c).get("rps_cmax")
        s_dec = d_c / d_p if d_p and d_c else None
        s_rps = r_c / r_p if r_p and r_c else None
        txt = (
            f"{p['name']} -> {c['name']}: bytes/pass ratio {byte_ratio:.2f}x"
            if byte_ratio
            else f"{p['name']} -> {c['name']}"
        )
        if s_dec is not None:
            txt += f", decode tok/s (c=1) {s_dec:.2f}x"
            faster &= s_dec > 1 + MARGIN
            if byte_ratio and byte_ratio > 1:
                shares.append((s_dec - 1) / (byte_ratio - 1))
        if s_rps is not None:
            txt += f", req/s at c={metrics_of(c).get('c_max')} {s_rps:.2f}x"
        parts.append(txt)
    evidence = "; ".join(parts) + (f" ({'; '.join(skipped)})" if skipped else "")
    if faster and shares and min(shares) >= 0.5:
        return finding(
            "2", title, REPRODUCED, evidence, "fewer bytes per weight give proportionally faster decode"
        )
    fixed = (a["configs"][0].get("prediction") or {}).get("t_fixed_ms")
    byte_ms = (a["configs"][0].get("prediction") or {}).get("t_bytes_ms")
    why = ""
    if fixed is not None and byte_ms is not None:
        why = (
            f"the baseline's pass takes ~{fixed + byte_ms:.2f} ms of which reading the weights is only "
            f"~{byte_ms:.2f} ms: fixed per-pass costs dominate a model this small, so shrinking the bytes can buy "
            "at most the byte share"
        )
    if faster:
        return finding(
            "2", title, PARTLY, evidence, "direction reproduced, magnitude below the byte ratio; " + why
        )
    return finding(
        "2", title, NOT_REPRODUCED, evidence, why or "quantized kernels cost compute the byte model ignores"
    )


def check_tensor_parallel(a: dict[str, Any]) -> dict[str, str]:
    title = "Tensor parallelism adds bandwidth but pays an all-reduce per layer: sub-linear"
    tp = [c for c in a["configs"] if c["lever"] == "tensor_parallel"]
    if not tp:
        return finding("4", title, NOT_TESTED, "", "the plan has no tensor-parallel step")
    done = [c for c in tp if c["status"] == "done"]
    if not done:
        return finding("4", title, NOT_TESTED, "", "; ".join(unavailable(c) for c in tp))
    byn = by_name(a)
    ev, sub = [], True
    for c in done:
        p = byn[c["parent"]]
        d, dp = metrics_of(c).get("decode_tok_s"), metrics_of(p).get("decode_tok_s")
        if d and dp:
            ev.append(
                f"{p['name']} -> {c['name']} (TP={c['levers'].tensor_parallel_size}): decode {d / dp:.2f}x"
            )
            sub &= d / dp < c["levers"].tensor_parallel_size
    return finding("4", title, REPRODUCED if ev and sub else NOT_REPRODUCED, "; ".join(ev), "")


def check_replicas_vs_tp(a: dict[str, Any]) -> dict[str, str]:
    """The reference's trade: TP is the lever for single-request latency, replicas (TP=1 copies) the lever for
    cost per token. Compares a replicas step with a tensor-parallel step made on the same parent: latency is the
    P50 at concurrency 1, throughput per core the output tokens/s at the highest concurrency over the ranks
    busy (TP x DP processes, one core each by default)."""
    title = "TP wins single-request latency; replicas win throughput per core"
    byn = by_name(a)
    dp = [c for c in a["configs"] if c["lever"] == "replicas"]
    pairs = [(t, d) for d in dp for t in a["configs"] if t["lever"] == "tensor_parallel" and t["parent"] == d["parent"]]
    if not pairs:
        return finding("4b", title, NOT_TESTED, "", "the plan has no replicas step beside a tensor-parallel step on the "
                  "same parent")
    ran = [(t, d) for t, d in pairs if t["status"] == "done" and d["status"] == "done"]
    if not ran:
        return finding("4b", title, NOT_TESTED, "", "; ".join(unavailable(c) for p in pairs for c in p if c["status"] != "done"))
    ev, wins = [], []
    for t, d in ran:
        lt, ld = metrics_of(t).get("e2e_p50_s"), metrics_of(d).get("e2e_p50_s")
        per_core = {}
        for c in (t, d):
            tput = metrics_of(c).get("out_tok_s_cmax")
            lv = c["levers"]
            per_core[c["name"]] = tput / (lv.tensor_parallel_size * lv.data_parallel_size) if tput else None
        pt, pd = per_core[t["name"]], per_core[d["name"]]
        if not (lt and ld and pt and pd):
            continue
        lat_winner = t if lt < ld * (1 - MARGIN) else d if ld < lt * (1 - MARGIN) else None
        tput_winner = d if pd > pt * (1 + MARGIN) else t if pt > pd * (1 + MARGIN) else None
        ev.append(
            f"on {byn[t['parent']]['name']}: latency (P50, concurrency 1) {t['name']} {lt:.2f} s vs {d['name']} "
            f"{ld:.2f} s: {lat_winner['name'] if lat_winner else 'a tie'} wins; output tok/s per core at "
            f"concurrency {metrics_of(d).get('c_max')}: {t['name']} {pt:.1f} vs {d['name']} {pd:.1f}: "
            f"{tput_winner['name'] if tput_winner else 'a tie'} wins"
        )
        wins.append((lat_winner is t, tput_winner is d))
    if not wins:
        return finding("4b", title, NOT_TESTED, "", "the steps ran but lack concurrency-1 latency or sweep throughput")
    both = all(a_ and b_ for a_, b_ in wins)
    one = any(a_ or b_ for a_, b_ in wins)
    status = REPRODUCED if both else PARTLY if one else NOT_REPRODUCED
    why = ("as the reference says: split the model to cut one request's latency, copy it to serve more per core"
           if both else "on this machine TP's all-reduces and shared memory bandwidth change the trade "
           "(docs/tensor-parallel.md: what to expect)")
    return finding("4b", title, status, "; ".join(ev), why)


def check_memory(a: dict[str, Any]) -> dict[str, str]:
    return finding(
        "5",
        "Faster memory is the cleanest lever",
        NOT_TESTED,
        f"this machine's measured read bandwidth: {a.get('bandwidth_gbs') or 0:.1f} GB/s",
        "one machine has one memory system; run the same plan on another machine and compare the two study "
        "folders: `leverlab study compare A B` sets each configuration's speedup against the bandwidth ratio",
    )


def check_multiply(a: dict[str, Any]) -> dict[str, str]:
    """Independence: the same lever change (same lever, same value) made on two different parents should give
    the same speedup; then stacked levers multiply. E.g. int8 -> int4 with and without EAGLE on top."""
    title = "Levers that target different terms multiply"
    byn = by_name(a)
    ev, ratios = [], []
    steps = [c for c in a["configs"] if c["parent"]]
    for i, c in enumerate(steps):
        for d in steps[i + 1 :]:
            if c["lever"] != d["lever"] or c["levers"].describe(c["lever"]) != d["levers"].describe(
                d["lever"]
            ):
                continue
            pc, pd = byn[c["parent"]], byn[d["parent"]]
            if byn[pc["name"]]["levers"].describe(c["lever"]) != byn[pd["name"]]["levers"].describe(
                d["lever"]
            ):
                continue
            vals = [metrics_of(x).get("decode_tok_s") for x in (c, pc, d, pd)]
            if not all(vals):
                continue
            s1, s2 = vals[0] / vals[1], vals[2] / vals[3]
            ratios.append(s2 / s1)
            ev.append(f"{c['change']}: {s1:.2f}x on {pc['name']}, {s2:.2f}x on {pd['name']}")
    if not ratios:
        stacked = [c for c in a["configs"] if c["name"] == "champion"]
        why = (
            unavailable(stacked[0])
            if stacked and stacked[0]["status"] != "done"
            else ("no lever change was made on two different parents that both ran")
        )
        return finding("6", title, NOT_TESTED, "", why)
    ok = all(abs(r - 1) <= 0.25 for r in ratios)
    return finding(
        "6",
        title,
        REPRODUCED if ok else NOT_REPRODUCED,
        "; ".join(ev),
        "the same change buys the same factor whatever else is on, so stacked levers multiply"
        if ok
        else "the change buys a different factor depending on what else is on: the levers interact",
    )


def check_batching(a: dict[str, Any]) -> dict[str, str]:
    """Static batches against continuous batching, at the sweep's top concurrency: continuous should serve
    more requests/s and answer sooner, since a static batch holds every slot until its longest member ends."""
    title = "Continuous batching beats static batches under load"
    ran = ran_step(a, "batching", lambda lv: lv.batching == "static",
                    "no static-batching step in this plan (the default plan has one)")
    if isinstance(ran, str):
        return finding("B", title, NOT_TESTED, "", ran)
    c, p = ran
    cmax = metrics_of(c).get("c_max")
    rs, rc = metrics_of(c).get("rps_cmax"), metrics_of(p).get("rps_cmax")
    ls = ((metrics_of(c).get("sweep") or {}).get(cmax) or {}).get("e2e_p50_s")
    lc = ((metrics_of(p).get("sweep") or {}).get(cmax) or {}).get("e2e_p50_s")
    if not (rs and rc and ls and lc):
        return finding("B", title, NOT_TESTED, "", "the sweep has no figures at the top concurrency")
    more, sooner = rc > rs * (1 + MARGIN), lc < ls * (1 - MARGIN)
    ev = (
        f"at concurrency {cmax}: continuous ({p['name']}) {rc:.3f} req/s, P50 {lc:.2f} s; static ({c['name']}) "
        f"{rs:.3f} req/s, P50 {ls:.2f} s (a request's wait for its batch included)"
    )
    status = REPRODUCED if more and sooner else PARTLY if more or sooner else NOT_REPRODUCED
    why = (
        "a static batch keeps every slot until its longest member ends and new requests wait for it"
        if status != NOT_REPRODUCED
        else "equal output lengths leave a static batch little idle time; the gap grows with mixed lengths"
    )
    return finding("B", title, status, ev, why)


def check_model(a: dict[str, Any]) -> dict[str, str]:
    """Right-sizing (the reference's first lever): the smaller model of the family serves faster, by about
    its byte ratio, and says other things; the fidelity columns say how much."""
    title = "Right-sizing: a smaller model of the family is faster, at a cost in fidelity"
    ran = ran_step(a, "model", lambda lv: bool(lv.model), "no model step in this plan (the default plan has one)")
    if isinstance(ran, str):
        return finding("R", title, NOT_TESTED, "", ran)
    c, p = ran
    d, dp = metrics_of(c).get("decode_tok_s"), metrics_of(p).get("decode_tok_s")
    if not (d and dp):
        return finding("R", title, NOT_TESTED, "", "no decode rate measured")
    pred = c.get("prediction") or {}
    bytes_ratio = (pred.get("byte_ratio_vs_baseline") or 0) / ((p.get("prediction") or {}).get(
        "byte_ratio_vs_baseline"
    ) or 1)
    agr = ((c.get("fidelity") or {}).get("agreement")) or {}
    ev = f"{p['name']} -> {c['name']}: decode {d / dp:.2f}x" + (
        f" (bytes per pass {bytes_ratio:.2f}x fewer)" if bytes_ratio else ""
    )
    if agr:
        ev += f"; {agr['identical']}/{agr['n']} greedy outputs identical to the baseline"
    faster = d > dp * (1 + MARGIN)
    changed = bool(agr) and agr.get("share_identical", 1.0) < 1.0
    status = REPRODUCED if faster and changed else PARTLY if faster else NOT_REPRODUCED
    why = (
        "fewer bytes per token; the outputs differ, so it is a lossy lever, judged on its fidelity"
        if faster
        else "the smaller model is not faster here: the fixed per-pass cost dominates a model this small"
    )
    return finding("R", title, status, ev, why)


def check_jump_forward(a: dict[str, Any]) -> dict[str, str]:
    """Structured output's jump-forward: on the agent workload (tool calls, JSON schemas whose keys and enum
    values the grammar forces), the same answers come sooner with it than decoded one pass per forced token."""
    title = "Jump-forward over grammar-forced tokens cuts structured-output latency, losslessly"
    ran = ran_step(a, "structured", lambda lv: not lv.structured_jump_forward,
                   "no structured step in this plan (--full has one: no-jump-forward)")
    if isinstance(ran, str):
        return finding("J", title, NOT_TESTED, "", ran)
    off, on = ran
    mo, mn = metrics_of(off).get("agent") or {}, metrics_of(on).get("agent") or {}
    lo, ln = mo.get("e2e_p50_s"), mn.get("e2e_p50_s")
    if not (lo and ln):
        return finding("J", title, NOT_TESTED, "", "the agent workload ran on one side only (or not at all)")
    ev = f"agent workload, P50 end-to-end at concurrency 1: jump-forward on ({on['name']}) {ln * 1e3:.0f} ms, " \
         f"off ({off['name']}) {lo * 1e3:.0f} ms ({lo / ln:.2f}x)"
    cmax = mn.get("c_max")
    so, sn = ((mo.get("sweep") or {}).get(cmax) or {}), ((mn.get("sweep") or {}).get(cmax) or {})
    if so.get("e2e_p50_s") and sn.get("e2e_p50_s"):
        ev += f"; at concurrency {cmax}: {sn['e2e_p50_s'] * 1e3:.0f} ms against {so['e2e_p50_s'] * 1e3:.0f} ms"
    faster = ln < lo * (1 - MARGIN)
    status = REPRODUCED if faster else NOT_REPRODUCED
    why = ("each forced token skips a decode pass; the next pass prefills them together, and the tokens are the "
           "same (plain constrained decoding takes a forced token without a draw too)" if faster
           else "these schemas force few tokens on this tokenizer, or the machine's noise hid the gain")
    return finding("J", title, status, ev, why)


def check_all(a: dict[str, Any]) -> list[dict[str, str]]:
    checks = (
        check_output_length,
        check_precision,
        check_ngram,
        check_separate_draft,
        check_exactness,
        check_tensor_parallel,
        check_replicas_vs_tp,
        check_memory,
        check_multiply,
        check_batching,
        check_model,
        check_jump_forward,
    )
    out = []
    for chk in checks:
        try:
            out.append(chk(a))
        except Exception as e:  # noqa: BLE001 - a check that cannot compute says so, the report still renders
            out.append(finding("?", chk.__name__, NOT_TESTED, "", f"could not compute: {type(e).__name__}: {e}"))
    return out
