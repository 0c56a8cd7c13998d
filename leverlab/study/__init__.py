"""`leverlab study`: the one-lever-at-a-time study, automated and measured, fidelity included.

plan.py       the baseline and steps (each changes exactly one lever), default/full plans
plan_files.py plans from YAML/TOML files and --steps
engines/      how to start a server for a configuration: LeverLab, llama.cpp, vLLM (flag mapping, gaps)
runner.py     per configuration: start, health, harness (leverlab.bench), counters, fidelity, stop; resume
fidelity.py   greedy token agreement, perplexity and KL against the baseline (in-process or over HTTP)
predict.py    the bandwidth model: bytes per step, tokens per pass -> predicted decode rate and speedup
findings.py   the reference study's findings checked against the measured numbers (findings_spec.py: the
              speculative ones; findings_common.py: statuses, thresholds, reading the analysis)
recommend.py  lowest latency / highest throughput / lowest cost per token
report/       Markdown + self-contained HTML (plots embedded as base64 PNG)
cli.py        `leverlab study`

A tool on the public API: may import leverlab.LLM, bench, and below them what it measures (speculative, models,
kernels, the plain types); nothing imports study but the CLI.
"""
