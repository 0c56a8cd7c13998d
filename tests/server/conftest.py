"""Real `leverlab serve` processes on free loopback ports, over a tiny random checkpoint.

`serve(ckpt, *flags)` starts one and waits for /health; the session-wide `server` is shared by the modules
that only send requests, while modules that need other limits (load) or end the server (shutdown) start their
own. The server's output goes to a log file, shown when a server fails to start.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, ckpt: Path, *flags: str, log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "leverlab.cli",
            "serve",
            str(ckpt),
            "--port",
            str(self.port),
            "--execution-mode",
            "eager",
            "--dtype",
            "float32",
            *flags,
        ]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as {name: value}."""
        return self.parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    @staticmethod
    def parse_metrics(text: str) -> dict[str, float]:
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) ([-+0-9.eEinfNa]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Wait until no request runs or waits and no KV block is held; return the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m.get("leverlab_num_requests_running") == 0
                and m.get("leverlab_num_requests_waiting") == 0
                and m.get("leverlab_kv_blocks_used") == 0
            ):
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.2)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory) -> Path:
    """The same shape with room for 8,192 positions: streams that must still be running when a test kills a
    process ask for thousands of tokens (the tiny model makes 480 in 0.3 s)."""
    return make_checkpoint(tmp_path_factory.mktemp("long") / "tiny-qwen3", arch="qwen3", max_position_embeddings=8192)


@pytest.fixture(scope="session")
def start_server(tmp_path_factory, checkpoint):
    """Factory: start_server(*flags, env=None, ckpt=None) -> ServerProcess serving `ckpt` (the session's tiny
    checkpoint by default); all stopped at the end of the session."""
    started: list[ServerProcess] = []

    def start(*flags: str, env: dict | None = None, ckpt: Path | None = None) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        s = ServerProcess(ckpt or checkpoint, *flags, log_path=log_path, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """The shared server with default limits; tests must leave it as they found it."""
    return start_server()
