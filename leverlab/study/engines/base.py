"""The engine adapter: how to start and stop an OpenAI-compatible server for one configuration.

An adapter maps engine-neutral Levers onto its server's flags, says which levers it cannot express (the
report prints the reason instead of a number), and knows whether it is installed at all. Starting is the
same for every engine: a subprocess with its output in a log file, polled until a health URL answers.
Invariant: a started ServerHandle is always stopped by the runner (try/finally), even when the harness fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from leverlab.study.plan import Levers

REPO = Path(__file__).resolve().parents[3]  # the repository root: plans name models/... from there

# An engine's refusal of a lever at start-up (LeverLab: exit 2 with a clear message, see server/cli.py).
UNAVAILABLE_EXIT_CODES = (2,)


class StartFailed(RuntimeError):
    """kind: "unavailable" (the engine refuses or cannot express the configuration: a fact for the report)
    or "failed" (it should have started and did not: a failure to look at)."""

    def __init__(self, reason: str, kind: str = "failed", log_tail: str = ""):
        super().__init__(reason)
        self.reason, self.kind, self.log_tail = reason, kind, log_tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def refusal_message(log: str) -> str:
    """The engine's own one-line reason, e.g. 'leverlab serve: speculative method 'eagle' is not built yet'."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "leverlab serve:" in ln or "error" in ln.lower():
            return ln.split("leverlab serve:", 1)[-1].strip()
    return lines[-1] if lines else "no message"


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    log_path: Path
    command: list[str]
    startup_s: float = 0.0

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the server (ours drains), SIGKILL after timeout; then SIGKILL to whatever is left of its
        process group (the server runs in its own session), so no child it spawned (a compiler, a worker)
        outlives it. Returns the server's exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode


def served_model(model: str, levers: Levers) -> str:
    """The model a configuration serves: the study's, or the model lever's folder (right-sizing), found from
    the repository root too as plans name models/... ."""
    if not levers.model:
        return model
    return str(resolve(levers.model) or levers.model)


def resolve(path: str) -> Path | None:
    """A model folder as given, else relative to the repository (plans name models/... from the repo root)."""
    for p in (Path(path), REPO / path):
        if p.exists():
            return p.resolve()
    return None


class Engine:
    name = "engine"
    health_path = "/health"
    # "inprocess": fidelity through the Python API (exact token ids, prompt logprobs);
    # "http": through the server's completions endpoint (any engine).
    fidelity_mode = "http"
    # Whether speculative steps also get the float32 spec-on/spec-off exactness pair through our Python API
    # (LeverLab only: another engine's speculation cannot be run in float32 here).
    inprocess_exactness = False

    def installed(self) -> str | None:
        """None when the engine can run here, else why not ("not installed: ...")."""
        return None

    def prepare(self, model: str, plan, workload: Path, say=print) -> dict:
        """Once per study, before the first configuration: files the engine needs made from the model (llama.cpp:
        GGUF per precision). Returns what it made, for study.json. Failures are kept for the configurations
        they concern (start() reports them), never raised."""
        return {}

    def unsupported(self, levers: Levers) -> dict[str, str]:
        """lever -> why this engine cannot express the value this configuration asks for."""
        return {}

    def weights(self, model: str, levers: Levers) -> str:
        """The folder this configuration serves (and in-process fidelity loads): the study's model, the model
        lever's folder, or a pre-quantized folder the engine was given for the precision (--checkpoint)."""
        return served_model(model, levers)

    def precheck(self, model: str, levers: Levers) -> str | None:
        """The engine's own refusal, found without starting a server (None: no refusal known up front).
        A refusal that only shows at start-up (exit code 2) is still caught by start()."""
        return None

    def runnable(self, model: str, levers: Levers) -> bool:
        return not (self.installed() or self.unsupported(levers) or self.precheck(model, levers))

    def command(self, model: str, levers: Levers, port: int) -> list[str]:
        raise NotImplementedError

    def extra_body(self, levers: Levers) -> dict[str, Any] | None:
        """Per-request fields that express a lever (llama.cpp's cache_prompt), or None."""
        return None

    def capabilities(self) -> dict[str, str]:
        """lever -> how this engine expresses it (or why it cannot), for the report's engine table."""
        return {}

    def env(self, levers: Levers | None = None) -> dict[str, str]:
        """The server's environment for this configuration (vLLM's CPU thread binding depends on its ranks)."""
        return dict(os.environ)

    def refusal(self, rc: int, log_path: Path) -> str | None:
        """The engine's own refusal when its server exits before it is healthy (None: a failure to look at).
        LeverLab refuses with exit 2 and one line (server/cli.py)."""
        return refusal_message(tail(log_path)) if rc in UNAVAILABLE_EXIT_CODES else None

    def start(self, model: str, levers: Levers, log_path: Path, timeout: float = 300.0) -> ServerHandle:
        why = self.installed()
        if why:
            raise StartFailed(why, "unavailable")
        gaps = self.unsupported(levers)
        if gaps:
            raise StartFailed("; ".join(f"{k}: {v}" for k, v in gaps.items()), "unavailable")
        refused = self.precheck(model, levers)
        if refused:
            raise StartFailed(refused, "unavailable")
        port = free_port()
        cmd = self.command(model, levers, port)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(levers), text=True, start_new_session=True
            )
        handle = ServerHandle(proc, f"http://127.0.0.1:{port}/v1", log_path, cmd)
        url = f"http://127.0.0.1:{port}{self.health_path}"
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc is not None:
                handle.stop(timeout=1)  # its children too
                refused = self.refusal(rc, log_path)
                if refused:
                    raise StartFailed(refused, "unavailable", tail(log_path))
                raise StartFailed(f"server exited with {rc}", "failed", tail(log_path))
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    handle.startup_s = time.monotonic() - t0
                    return handle
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        handle.stop(timeout=10)
        raise StartFailed(f"not healthy after {timeout:.0f} s", "failed", tail(log_path))
