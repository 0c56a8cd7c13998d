"""Does the faster configuration still say the same thing? Fidelity against the baseline, same prompts.

Three measures, each from one pass per configuration over the same prompts:
  greedy agreement   temperature 0, fixed length: share of prompts whose outputs are identical, and the mean
                     position of the first differing token (an identical output counts as its full length);
  perplexity         exp(-mean log p(prompt token | prefix)) over the prompts' tokens (teacher-forced);
  KL(base || cfg)    of next-token distributions at every prompt position, from the top-k prompt logprobs.

KL from top-k lists: both sides only know their own top-k (plus the actual token). Over the tokens known on
BOTH sides, with everything else merged into one "rest" bucket per side, the KL of those coarse-grained
distributions is a lower bound of the true KL (merging outcomes never increases a KL divergence). With k=20
of an 8k vocabulary it catches every change that moves the likely tokens; it is reported as a lower bound.

Two ways to collect (the report says which was used):
  http        any engine, LeverLab's by default: /v1/completions from the configuration's running server, with
              logprobs (token ids where the server returns them as `token_id:N`, as ours and vLLM's do; else
              token strings) and vLLM's `prompt_logprobs` extension when the server honours it (else
              perplexity/KL are n/a). Through our server the ids and prompt logprobs equal the in-process
              collection's (checked on the bundled model), without a process and a model load per
              configuration.
  in-process  `--fidelity inprocess`: the Python API (LLM) with the configuration's levers, eager mode.
Speculative configurations are also checked for exactness: speculation on and off, both in float32, must
give identical greedy tokens; anything else is a bug and is flagged. That pair always runs in-process
(a float32 model of its own, spec on and off): with HTTP fidelity, once the study's servers are done, every
speculative configuration's pair in one worker process (collect_exactness).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPT_LOGPROBS_K = 20

Key = str  # token ids as strings (JSON keys), or token texts for servers that return only text


# ---- math ------------------------------------------------------------------------------------------------


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first differing position; None when identical. A length difference diverges at the
    shorter length."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_agreement(ref: Sequence[Sequence[Any]], got: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """share_identical over prompts; mean_first_divergence with identical outputs counted at full length."""
    if len(ref) != len(got) or not ref:
        raise ValueError(f"need the same non-zero number of outputs, got {len(ref)} and {len(got)}")
    divs = [first_divergence(a, b) for a, b in zip(ref, got)]
    identical = sum(d is None for d in divs)
    positions = [len(a) if d is None else d for a, d in zip(ref, divs)]
    diverged = [d for d in divs if d is not None]
    return {
        "n": len(ref),
        "identical": identical,
        "share_identical": identical / len(ref),
        "mean_first_divergence": sum(positions) / len(positions),
        "mean_first_divergence_diverged": (sum(diverged) / len(diverged)) if diverged else None,
        "compared_tokens": max(len(a) for a in ref),
    }


def perplexity(prompt_logprobs: Sequence[dict[Key, float] | None], targets: Sequence[Key]) -> float:
    """exp(-mean log p(target_i)) over positions with a distribution (position 0 has none)."""
    lps = [d[t] for d, t in zip(prompt_logprobs, targets) if d is not None and t in d]
    if not lps:
        return math.nan
    return math.exp(-sum(lps) / len(lps))


def kl_topk(p: dict[Key, float], q: dict[Key, float]) -> float:
    """KL(P || Q) in nats over the tokens known on both sides plus one merged 'rest' bucket: a lower bound."""
    common = [t for t in p if t in q]
    if not common:
        return math.nan
    kl = 0.0
    for t in common:
        kl += math.exp(p[t]) * (p[t] - q[t])
    rest_p = max(0.0, 1.0 - sum(math.exp(p[t]) for t in common))
    rest_q = max(0.0, 1.0 - sum(math.exp(q[t]) for t in common))
    if rest_p > 1e-12:
        kl += rest_p * (math.log(rest_p) - math.log(max(rest_q, 1e-12)))
    return max(0.0, kl)


def mean_kl(
    ref: Sequence[dict[Key, float] | None], got: Sequence[dict[Key, float] | None]
) -> dict[str, float]:
    vals = [kl_topk(a, b) for a, b in zip(ref, got) if a is not None and b is not None]
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return {"mean": math.nan, "max": math.nan, "positions": 0}
    return {"mean": sum(vals) / len(vals), "max": max(vals), "positions": len(vals)}


def compare(base: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Fidelity of one configuration's collection against the baseline's (same prompt ids)."""
    b = {s["id"]: s for s in base["samples"]}
    c = {s["id"]: s for s in cfg["samples"]}
    ids = [i for i in b if i in c]
    out: dict[str, Any] = {"source": cfg.get("source"), "prompts": len(ids)}
    if not ids:
        out["error"] = "no common prompts"
        return out
    out["agreement"] = token_agreement([b[i]["output"] for i in ids], [c[i]["output"] for i in ids])
    out["unit"] = cfg.get("unit", "tokens")
    if all(b[i].get("prompt_logprobs") and c[i].get("prompt_logprobs") for i in ids):
        ref = [d for i in ids for d in b[i]["prompt_logprobs"]]
        got = [d for i in ids for d in c[i]["prompt_logprobs"]]
        targets = [t for i in ids for t in b[i]["prompt_tokens"]]
        out["perplexity"] = perplexity(got, targets)
        out["perplexity_baseline"] = perplexity(ref, targets)
        out["kl"] = mean_kl(ref, got)
    else:
        out["perplexity"] = out["perplexity_baseline"] = None
        out["kl"] = None
        out["logprobs_note"] = cfg.get("logprobs_note") or base.get("logprobs_note") or "no prompt logprobs"
    if cfg.get("exactness"):
        out["exactness"] = cfg["exactness"]
    return out


def exactness(
    spec_outputs: Sequence[Sequence[Any]], plain_outputs: Sequence[Sequence[Any]]
) -> dict[str, Any]:
    """Speculation must not change greedy tokens: both lists come from float32 runs, spec on and off."""
    agr = token_agreement(plain_outputs, spec_outputs)
    return {**agr, "exact": agr["share_identical"] == 1.0, "dtype": "float32"}


# ---- collection: in-process (LeverLab) -------------------------------------------------------------------


def inprocess_spec(
    model: str, levers: dict[str, Any], prompts: list[dict], tokens: int, exactness: bool = True
) -> dict[str, Any]:
    """The worker's input: the served run (with prompt logprobs), plus a float32 spec-on/spec-off pair for
    speculative configurations (greedy only) unless exactness=False."""
    runs = [{"name": "served", "levers": levers, "prompt_logprobs": True}]
    if levers.get("speculative") and exactness:
        f32 = {**levers, "dtype": "float32"}
        runs.append({"name": "spec_f32", "levers": f32, "prompt_logprobs": False})
        runs.append({"name": "plain_f32", "levers": {**f32, "speculative": None}, "prompt_logprobs": False})
    return {"model": model, "prompts": prompts, "tokens": tokens, "runs": runs}


def collect_inprocess(
    model: str,
    levers: dict[str, Any],
    prompts: list[dict],
    tokens: int,
    workdir: Path,
    timeout: float = 900,
    exactness: bool = True,
) -> dict[str, Any]:
    """Runs the worker in a subprocess (a crash or a refused lever cannot take the study down)."""
    spec = inprocess_spec(model, levers, prompts, tokens, exactness)
    return _in_subprocess("fidelity", [], spec, workdir, "fidelity-samples.json", timeout)


def _in_subprocess(name: str, flags: list[str], spec: dict, workdir: Path, out_name: str, timeout: float) -> Any:
    """`python -m leverlab.study.fidelity [flags] SPEC OUT` in workdir (<name>-spec.json, <name>.log): its JSON."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = workdir / f"{name}-spec.json", workdir / out_name, workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        rc = subprocess.run(
            [sys.executable, "-m", "leverlab.study.fidelity", *flags, str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        ).returncode
    if rc != 0 or not out_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{name} worker exited with {rc}:\n{tail}")
    return json.loads(out_path.read_text())


def _engine_kwargs(lv: dict[str, Any]) -> dict[str, Any]:
    spec = lv.get("speculative")
    if spec and spec.get("model"):
        from leverlab.study.engines.base import resolve

        spec = {**spec, "model": str(resolve(spec["model"]) or spec["model"])}
    return {
        "dtype": lv["dtype"],
        "quantization": lv.get("quantization"),
        "kv_cache_dtype": lv.get("kv_cache_dtype", "auto"),
        "speculative_config": spec,
        "enable_prefix_caching": lv.get("prefix_caching", True),
        "tensor_parallel_size": lv.get("tensor_parallel_size", 1),
        "max_num_seqs": lv.get("max_num_seqs", 64),
        "execution_mode": "eager",
    }


def _run(model: str, levers: dict[str, Any], prompts: list[dict], tokens: int, prompt_logprobs: bool) -> dict:
    """One configuration through the Python API: greedy samples (and prompt logprobs), and the seconds taken."""
    from leverlab import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, **_engine_kwargs(levers))
    params = SamplingParams(
        temperature=0,
        max_tokens=tokens,
        ignore_eos=True,
        prompt_logprobs=PROMPT_LOGPROBS_K if prompt_logprobs else None,
    )
    outs = llm.generate([p["text"] for p in prompts], params)
    samples = []
    for p, o in zip(prompts, outs):
        s: dict[str, Any] = {"id": p["id"], "output": [str(t) for t in o.outputs[0].token_ids]}
        if prompt_logprobs and o.prompt_logprobs is not None:
            s["prompt_tokens"] = [str(t) for t in o.prompt_token_ids]
            s["prompt_logprobs"] = [
                None if d is None else {str(k): v.logprob for k, v in d.items()} for d in o.prompt_logprobs
            ]
        samples.append(s)
    llm.engine.close()  # tensor parallel: stop its workers before the next run starts its own
    del llm
    return {"samples": samples, "seconds": time.perf_counter() - t0}


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    prompts = spec["prompts"]
    result: dict[str, Any] = {
        "source": "in-process (LeverLab Python API, eager)",
        "unit": "tokens",
        "runs": {},
    }
    for run in spec["runs"]:
        result["runs"][run["name"]] = _run(spec["model"], run["levers"], prompts, spec["tokens"], run["prompt_logprobs"])
    result["samples"] = result["runs"]["served"]["samples"]
    if "spec_f32" in result["runs"]:
        result["exactness"] = exactness(
            [s["output"] for s in result["runs"]["spec_f32"]["samples"]],
            [s["output"] for s in result["runs"]["plain_f32"]["samples"]],
        )
    return result


# ---- exactness of several speculative configurations, in one process ----------------------------------------


def collect_exactness(jobs: list[dict[str, Any]], workdir: Path, timeout: float = 1800) -> dict[str, dict]:
    """The float32 spec-on/spec-off pairs of several configurations (jobs: name, model, levers, prompts, tokens)
    in one worker process, after their servers have run: one interpreter start and torch import for all of
    them, and one plain run for configurations that differ only in their speculation (a study's int8 + n-gram,
    + adaptive n-gram, + draft and + EAGLE share theirs). Returns {name: {"exactness": ...} or {"error": ...}}."""
    return _in_subprocess("exactness", ["--exactness"], {"jobs": jobs}, workdir, "exactness.json", timeout)


def _exactness_worker(spec: dict[str, Any]) -> dict[str, dict]:
    plain_runs: dict[str, dict] = {}  # by the plain configuration's levers
    out: dict[str, dict] = {}
    for job in spec["jobs"]:
        f32 = {**job["levers"], "dtype": "float32"}
        plain = {**f32, "speculative": None}
        key = json.dumps([job["model"], plain], sort_keys=True)
        try:
            on = _run(job["model"], f32, job["prompts"], job["tokens"], False)
            reused = key in plain_runs
            if not reused:
                plain_runs[key] = _run(job["model"], plain, job["prompts"], job["tokens"], False)
            off = plain_runs[key]
            out[job["name"]] = {
                "exactness": exactness([s["output"] for s in on["samples"]], [s["output"] for s in off["samples"]]),
                "seconds": on["seconds"],
                "plain_reused": reused,
            }
        except Exception as e:  # noqa: BLE001 - one configuration's failure is its own, the others still run
            out[job["name"]] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ---- collection: HTTP (any engine) -----------------------------------------------------------------------


def collect_http(
    base_url: str,
    model: str | None,
    prompts: list[dict],
    tokens: int,
    extra_body: dict | None = None,
    transport: Any = None,
) -> dict[str, Any]:
    """Greedy completions with logprobs; vLLM's `prompt_logprobs` asked for and used when returned."""
    import httpx

    base = base_url.rstrip("/")
    with httpx.Client(timeout=600, transport=transport) as client:
        if model is None:
            model = client.get(f"{base}/models").json()["data"][0]["id"]
        samples, unit, got_plp = [], "tokens", True
        for p in prompts:
            body = {
                "model": model,
                "prompt": p["text"],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "prompt_logprobs": PROMPT_LOGPROBS_K,
                # vLLM: tokens as "token_id:N" (exact ids, not texts); ignored by servers without it
                "return_tokens_as_token_ids": True,
                **(extra_body or {}),
            }
            r = client.post(f"{base}/completions", json=body)
            if r.status_code == 400 and "prompt_logprobs" in r.text:
                body.pop("prompt_logprobs")
                r = client.post(f"{base}/completions", json=body)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            lp = choice.get("logprobs") or {}
            if lp.get("tokens"):
                # "token_id:N" (return_tokens_as_token_ids) -> "N", as the in-process collection writes ids
                out = [t[len("token_id:"):] if t.startswith("token_id:") else t for t in lp["tokens"]]
            else:  # a server without per-token logprobs: compare characters
                out, unit = list(choice.get("text", "")), "characters"
            s: dict[str, Any] = {"id": p["id"], "output": out}
            plp = choice.get("prompt_logprobs") or r.json().get("prompt_logprobs")
            if plp:
                s["prompt_logprobs"], s["prompt_tokens"] = _vllm_prompt_logprobs(plp, choice)
            else:
                got_plp = False
            samples.append(s)
    res = {"source": "http (each server's /v1/completions)", "unit": unit, "samples": samples}
    if not got_plp:
        res["logprobs_note"] = "the server returned no prompt_logprobs, so perplexity and KL are n/a"
        for s in samples:
            s.pop("prompt_logprobs", None)
    return res


def _vllm_prompt_logprobs(plp: list, choice: dict) -> tuple[list, list]:
    """vLLM: [None, {"<id>": {"logprob": x, "rank": r, "decoded_token": s}, ...}, ...]. The prompt's own token
    at each position is taken from `prompt_token_ids` when the server returns them, else the rank-ordered
    entry that is not in the top-k ranks is unknowable, so the most likely entry stands in (flagged)."""
    dists: list = []
    targets: list = []
    ids = choice.get("prompt_token_ids")
    for i, d in enumerate(plp):
        if d is None:
            dists.append(None)
            targets.append(str(ids[i]) if ids else "")
            continue
        dist = {str(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in d.items()}
        dists.append(dist)
        targets.append(str(ids[i]) if ids else max(dist, key=dist.get))
    return dists, targets


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    work = _worker
    if argv and argv[0] == "--exactness":
        work, argv = _exactness_worker, argv[1:]
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(work(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
