#!/usr/bin/env bash
# LeverLab's main job on a fresh clone: the one-lever-at-a-time study on the bundled model.
# The report lands in results/study-<timestamp>/ (report.md, report.html). Extra arguments go to the study.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m leverlab.cli study "$@"
