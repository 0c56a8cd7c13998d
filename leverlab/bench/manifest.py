"""The reproducibility manifest: enough to rerun a result and to know what it measured."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict[str, Any]:
    import leverlab

    root = Path(leverlab.__file__).resolve().parent.parent
    rev = _run(["git", "rev-parse", "HEAD"], root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"revision": rev, "dirty": bool(status) if status is not None else None}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    if shutil.which("nvidia-smi"):
        gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
        if gpus:
            info["gpus"] = gpus.splitlines()
    return info


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def harness_versions() -> dict[str, str]:
    import httpx

    import leverlab

    return {"leverlab": leverlab.__version__, "httpx": httpx.__version__}
