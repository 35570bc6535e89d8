"""``--processes N``: N server processes behind the same HTTP and gRPC ports (by default one per GPU).

One process serves every request through one event loop and one GIL; that loop, not the GPU, bounds
what the service answers (see docs/benchmarks/service.md#throughput). With N processes each has its
own loop, engine and batcher:

- the devices are dealt out: with N <= the device count, process i gets devices i, i+N, ...;
  with more processes than devices, process i shares device i mod count with the others dealt it;
  on the CPU each process gets 1/N of the cores for torch's threads (unless OMP_NUM_THREADS is set);
- this supervisor binds one HTTP listening socket per process, all on the same port with
  SO_REUSEPORT, and process i accepts on socket i (inherited): the kernel hashes each new
  connection to one of them, so connections spread evenly. (One shared socket would let whichever
  process wakes first accept; on Linux that is often the same one for every connection.) Each
  process binds the gRPC port itself (grpc sets SO_REUSEPORT), and the kernel spreads channels;
- Prometheus series are kept per process in files of a private folder
  (``PROMETHEUS_MULTIPROC_DIR``) and ``/metrics`` of any process sums them over all;
- SIGTERM/SIGINT go on to every process, each drains as a lone server does; if one process exits
  by itself, the others are stopped and the supervisor exits with its code.

What is per process: the batcher (requests batch only with others that reached the same process),
``/readyz`` (the process that answers), ``--max-queue-size``. A gRPC channel or an HTTP keep-alive
connection stays on one process: spread load over several connections.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from service.settings import Settings

log = logging.getLogger("attnserve.processes")

POLL_S = 0.2


def deal_devices(devices: Sequence[str], processes: int) -> list[str]:
    """The ``--device`` value of each of ``processes`` processes, e.g. (["cuda:0", "cuda:1"], 2) ->
    ["cuda:0", "cuda:1"]; (["cuda:0", "cuda:1"], 1) -> ["cuda:0,cuda:1"]; (["cpu"], 3) -> ["cpu"] * 3."""
    if processes <= len(devices):
        return [",".join(devices[i::processes]) for i in range(processes)]
    return [devices[i % len(devices)] for i in range(processes)]


def process_count(settings: Settings) -> int:
    """How many server processes ``--processes`` asks for: 0 means one per GPU of ``--device``, one
    on the CPU (or when ``--device`` is not valid: the lone server then says why it cannot start).

    Why one per GPU: two workers behind one event loop answer about what one GPU does, two
    processes about twice that (see docs/benchmarks/service.md#throughput)."""
    if settings.processes:
        return settings.processes
    from service.core.devices import resolve_devices

    try:
        devices = resolve_devices(settings.device)
    except ValueError:
        return 1
    return len(devices) if all(d.type == "cuda" for d in devices) else 1


def http_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` inheritable listening sockets on ``host:port``, all with SO_REUSEPORT (port 0: a
    free port); raises OSError when the port cannot be bound.

    A plain bind comes first: SO_REUSEPORT alone would let a second server of the same user share
    the port silently instead of failing to start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, port), family=family) as probe:
        port = probe.getsockname()[1]
    listeners: list[socket.socket] = []
    try:
        for _ in range(count):
            listener = socket.create_server((host, port), family=family, backlog=2048, reuse_port=True)
            listener.set_inheritable(True)
            listeners.append(listener)
    except OSError:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def bind_error(host: str, port: int) -> str | None:
    """Why a plain bind of ``host:port`` fails (in use, a privileged port, an address not this
    host's), or None when it succeeds."""
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def supervise(settings: Settings, argv: Sequence[str], processes: int) -> int:
    """Start ``processes`` servers (``python -m service`` with ``argv`` and this process's share of
    the devices), forward signals, wait; the exit code (0 after a clean stop)."""
    from service.core.devices import resolve_devices

    try:
        devices = [str(d) for d in resolve_devices(settings.device)]
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    shares = deal_devices(devices, processes)
    try:
        listeners = http_listeners(settings.host, settings.http_port, len(shares))
    except OSError as exc:
        log.error("cannot bind HTTP %s:%d: %s", settings.host, settings.http_port, exc)
        return 1
    # the processes bind the gRPC port with SO_REUSEPORT: a plain bind first, as for HTTP
    if settings.grpc_port and (reason := bind_error(settings.host, settings.grpc_port)):
        for listener in listeners:
            listener.close()
        log.error("cannot bind gRPC %s:%d: %s", settings.host, settings.grpc_port, reason)
        return 1
    sweep_stale_folders()
    metrics_dir = tempfile.mkdtemp(prefix=f"attnserve-metrics-{os.getpid()}-")
    peers_dir = tempfile.mkdtemp(prefix=f"attnserve-peers-{os.getpid()}-")  # 0700: each process's private sockets
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    if all(s == "cpu" for s in shares) and "OMP_NUM_THREADS" not in env:
        # CPU workers compute with torch's thread pool: N pools of every core would oversubscribe
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(shares)))
    stopping = False
    children: list[subprocess.Popen] = []

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        for i, (share, listener) in enumerate(zip(shares, listeners, strict=True)):
            if stopping:  # a signal while starting them: start no more
                break
            cmd = [sys.executable, "-m", "service", *argv,
                   "--processes", "1", "--device", share, "--http-fd", str(listener.fileno()),
                   "--peers", f"{i}/{len(shares)}@{peers_dir}"]
            children.append(subprocess.Popen(cmd, env=env, pass_fds=(listener.fileno(),)))
            # only the child holds its socket now: once it exits, the kernel hashes no connection there
            # (one kept open here stayed in the SO_REUSEPORT group, accepted by nobody: a drain hung them)
            listener.close()
            log.info("process %d (pid %d) on %s", i, children[-1].pid, share)
        log.info("%d processes serving HTTP on %s:%d%s", len(children), settings.host, settings.http_port,
                 f" and gRPC on {settings.host}:{settings.grpc_port}" if settings.grpc_port else "")
        running = list(children)
        while running:
            time.sleep(POLL_S)
            for child in [c for c in running if c.poll() is not None]:
                running.remove(child)
                _process_dead(child.pid, metrics_dir)
                if not stopping:
                    log.error("process pid %d exited with code %d; stopping the others", child.pid,
                              child.returncode)
                    code = child.returncode if child.returncode > 0 else 1  # killed by a signal: 1
                    stop()
                elif child.returncode:
                    code = code or (child.returncode if child.returncode > 0 else 1)
        return code
    finally:
        stop()
        for child in children:
            child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for listener in listeners:
            listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(peers_dir, ignore_errors=True)


_FOLDER = re.compile(r"attnserve-(?:metrics|peers)-(\d+)-")


def sweep_stale_folders() -> None:
    """Remove the metrics and peers folders of supervisors that are gone: one killed by SIGKILL
    could not remove its own (its processes exit, the folders stay). Only this user's folders whose
    supervisor's pid runs no process are taken."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            m = _FOLDER.match(name)
            path = os.path.join(root, name)
            if m is None or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(path, ignore_errors=True)
            except OSError:  # (a process of another user has the pid: not ours to judge)
                pass


def _process_dead(pid: int, metrics_dir: str) -> None:
    """Drop a finished process's live gauges from the shared metrics (its counters stay counted)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, metrics_dir)


__all__ = ["deal_devices", "process_count", "supervise"]
