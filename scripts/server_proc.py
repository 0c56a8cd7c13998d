"""Servers the benchmark scripts start and stop themselves: a free loopback port, waiting for health, stopping.

Used by bench_peer.py (ours and llama-server), bench_replicas.py and fuzz_server.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    """Until GET /health answers 200 (llama-server answers 503 while it loads), the process dies, or timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        time.sleep(0.5)
    return False


def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the server we started (by its pid), SIGKILL if it does not exit within grace_s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
