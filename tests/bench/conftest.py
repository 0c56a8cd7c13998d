from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not up after {timeout}s")


@pytest.fixture(scope="session")
def fake_server():
    """The stand-in server in its own process (its event loop never competes with the client's)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_server.py"), str(port)])
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def write_workload(path: Path, buckets: dict[str, tuple[int, list[str]]]) -> Path:
    """A tiny prompt-set file of the bundled schema: {bucket: (output_len, [prompt texts])}."""
    data = {
        "provenance": {"test": True},
        "buckets": {
            name: {
                "input_tokens": 8,
                "output_len": ol,
                "prompts": [
                    {"id": f"{name}-{i:03d}", "source": "test", "text": t, "num_tokens": 8}
                    for i, t in enumerate(texts)
                ],
            }
            for name, (ol, texts) in buckets.items()
        },
        "chat": [
            {
                "id": "chat-000",
                "kind": "explain",
                "source": "test",
                "messages": [{"role": "user", "content": "[ttft=60 itl=10] explain"}],
            }
        ],
    }
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def make_workload(tmp_path):
    """make_workload({bucket: (output_len, [texts])}) -> path of a prompt-set file in tmp_path."""
    counter = iter(range(1000))
    return lambda buckets: write_workload(tmp_path / f"workload-{next(counter)}.json", buckets)
