"""A short run of scripts/fuzz_server.py against the shared server (the full 10,000-request run is manual:
`python scripts/fuzz_server.py`). Slow: kept out of the default suite's fast path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.conftest import ROOT


@pytest.mark.slow
def test_generated_requests_never_5xx(server):
    r = subprocess.run([sys.executable, "scripts/fuzz_server.py", "--base-url", server.url, "--requests", "400",
                        "--seed", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["requests"] == 400 and figures["5xx_or_failed"] == 0 and figures["alive"]
    assert figures["kv_blocks_used_after"] == 0
