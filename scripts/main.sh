#!/usr/bin/env bash
# LeverLab's main job on a fresh clone. Until `leverlab study` lands, it runs the decode benchmark:
# LeverLab against transformers on a Qwen3-0.6B-shaped checkpoint, with the bandwidth roofline.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python scripts/bench_decode.py "$@"
