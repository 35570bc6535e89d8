"""A server of a benchmark's own: ``python -m service`` on free ports, used once ``/readyz`` says so.

    with local_server("--device", "cuda:0", "--warmup-shapes", "1x8x128x64") as s:
        s.url, s.grpc_target, s.pid
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalServer:
    url: str
    grpc_target: str | None  # None: gRPC off
    pid: int


@contextlib.contextmanager
def local_server(*args: str, grpc: bool = True, timeout: float = 600.0) -> Iterator[LocalServer]:
    """Start ``python -m service --host 127.0.0.1`` on free ports with ``args`` (TRITON_INTERPRET
    dropped: a benchmark runs the real kernels); stop it on exit."""
    http_port, grpc_port = free_port(), free_port() if grpc else 0
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not get ready in {timeout:.0f} s")
            time.sleep(0.2)
        yield LocalServer(url, f"127.0.0.1:{grpc_port}" if grpc else None, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
