"""Shared test fixtures: GPU skipping, and a real server process on free ports."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()

# Triton's interpreter is chosen when a kernel module is imported: set it before any test imports one.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # ... and decorate every kernel now: a test that unsets it for the CPU path (test_batcher) must
    # not be the first to import one, or the kernels stay compiled-mode for the rest of the run
    import kernels.autograd  # noqa: E402, F401
    import kernels.flash_v1  # noqa: E402, F401


def random_qkv(shape, dtype=torch.float32, seed=0):
    """q (B, Hq, Nq, D), k, v (B, Hkv, Nk, D) from shape (B, Hq, Hkv, Nq, Nk, D): normal values,
    drawn in that order from one seeded generator, then cast to ``dtype``."""
    b, hq, hkv, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    return q, k, v


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    """A TCP port free now, below Linux's ephemeral range (32768 and up): a port from that range
    can be taken as the local port of any client connection on the host (another test's, another
    suite's) between this check and the server's bind, seconds later, once the server has started."""
    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def run_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
               wait_ready: bool = True, timeout: float = 120.0) -> Iterator[ServerProcess]:
    """Start ``python -m service`` on free ports (CPU unless args say otherwise); stop it after.
    A server that lost a port it was given to another process before it could bind it is started
    again on new ports (twice at most), unless the test chose the ports: whether it exited for it, or
    the other process (another suite's server) answered for it (``PortTaken``)."""
    own_ports = "--http-port" in args or "--grpc-port" in args
    for attempt in range(3):
        server = _start_server(tmp_path, args, env)
        try:
            if wait_ready:
                try:
                    _wait_ready(server, timeout)
                except RuntimeError as exc:
                    if attempt < 2 and not own_ports and (isinstance(exc, PortTaken) or _lost_its_port(server)):
                        continue
                    raise
            yield server
            return
        finally:
            _stop_server(server)


def _start_server(tmp_path: Path, args: tuple[str, ...], env: dict[str, str] | None) -> ServerProcess:
    http_port, grpc_port = free_port(), free_port()
    while grpc_port == http_port:
        grpc_port = free_port()
    log_path = tmp_path / f"server-{http_port}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    full_env.pop("TRITON_INTERPRET", None)  # the server uses the CPU path unless a test asks
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), *args]
    if "--device" not in args:
        cmd += ["--device", "cpu"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(proc, http_port, grpc_port, log_path)


def _lost_its_port(server: ServerProcess) -> bool:
    log = server.log().lower()
    return server.proc.returncode not in (None, 0) and any(
        s in log for s in ("address already in use", "errno 98", "failed to bind"))


def _stop_server(server: ServerProcess) -> None:
    proc = server.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class PortTaken(RuntimeError):
    """Another process listens on a port the server was given: a ready answer there may be its."""


def _wait_ready(server: ServerProcess, timeout: float) -> None:
    """Until /readyz answers 200 and only the server's processes listen on its ports: a 200 from a
    process that bound a port first (its own free pick, made in the same seconds) is not this server's."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/readyz", timeout=1.0).status_code == 200:
                taken = _ports_taken(server)
                if taken:
                    raise PortTaken(f"another process listens on port {taken} of the server:\n{server.log()}")
                return
        time.sleep(0.1)
    raise TimeoutError(f"server not ready after {timeout}s:\n{server.log()}")


def _ports_taken(server: ServerProcess) -> list[int]:
    """The server's TCP ports (HTTP, and gRPC unless off) on which a process other than the server
    and its children listens (grpc's SO_REUSEPORT lets two servers share a port silently); [] where
    /proc cannot tell."""
    args = list(server.proc.args)
    grpc = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--grpc-port"]
    ports = [server.http_port] + ([int(grpc[-1])] if grpc and int(grpc[-1]) else [])
    listeners: dict[int, set[int]] = {}  # port -> inodes of the sockets listening on it
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listeners.setdefault(int(fields[1].rsplit(":", 1)[1], 16), set()).add(int(fields[9]))
    ours = {int(link[8:-1]) for link in _fd_links(_process_tree(server.proc.pid)) if link.startswith("socket:[")}
    return [p for p in ports if listeners.get(p, set()) - ours]


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (under --processes the children listen on the gRPC port)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _fd_links(pids: list[int]) -> list[str]:
    links = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    links.append(os.readlink(fd.path))
    return links


# A CPU server that starts fast: HTTP only, one tiny warm-up shape.
FAST = ("--grpc-port", "0", "--warmup-shapes", "1x1x16x16", "--warmup-dtypes", "float32")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """(folder, tensors) of a one-layer BERT checkpoint (hidden 40, 5 heads) written by the test."""
    from tests.layer_fixtures import write_bert

    folder = tmp_path_factory.mktemp("bert")
    return folder, write_bert(folder, hidden_size=40, num_heads=5, num_layers=1)


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One real CPU server per test module (default options)."""
    with run_server(tmp_path_factory.mktemp("server")) as server:
        yield server
