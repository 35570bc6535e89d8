"""--processes N: several server processes behind one HTTP and one gRPC port (service/processes.py)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch as st
import torch

from service.client import GrpcAttentionClient
from service.processes import deal_devices, process_count
from service.settings import load_settings
from tests.conftest import run_server
from tests.helpers import attention64


def test_devices_are_dealt_out():
    assert deal_devices(["cuda:0", "cuda:1"], 2) == ["cuda:0", "cuda:1"]
    assert deal_devices(["cuda:0", "cuda:1"], 1) == ["cuda:0,cuda:1"]
    assert deal_devices(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 2) == ["cuda:0,cuda:2", "cuda:1,cuda:3"]
    assert deal_devices(["cuda:0"], 3) == ["cuda:0"] * 3
    assert deal_devices(["cuda:0", "cuda:1"], 3) == ["cuda:0", "cuda:1", "cuda:0"]


def test_default_is_one_process_per_gpu(monkeypatch):
    """--processes 0 (the default): one process per GPU of --device, one on the CPU; a number
    given is kept; a bad --device leaves one process, which then reports it."""
    import service.core.devices as devices

    assert load_settings([]).processes == 0
    assert process_count(load_settings(["--device", "cpu"])) == 1
    assert process_count(load_settings(["--device", "cpu", "--processes", "3"])) == 3
    assert process_count(load_settings(["--device", "tpu:0"])) == 1
    # two GPUs, as resolve_devices reports them on a 2-GPU host (none here)
    monkeypatch.setattr(devices, "resolve_devices", lambda spec: [torch.device("cuda", 0), torch.device("cuda", 1)])
    assert process_count(load_settings(["--device", "cuda"])) == 2
    assert process_count(load_settings(["--device", "cuda", "--processes", "1"])) == 1


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":\t", 1) for line in f if ":\t" in line)
            except OSError:
                continue
            if fields.get("PPid", "").strip() == str(pid) and fields.get("State", "").strip()[:1] != "Z":
                out.append(int(entry))
    return out


def accepted(pids: list[int], port: int, state: str = "01") -> list[int]:
    """How many TCP sockets on local ``port`` in ``state`` (01 established, 0A listening) each of
    ``pids`` holds (from /proc/net/tcp and each process's fds)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == state:
                inodes.add(fields[9])
    counts = []
    for pid in pids:
        fds = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
        counts.append(sum(link[8:-1] in inodes for link in fds if link.startswith("socket:[")))
    return counts


def post(url: str, body: bytes) -> httpx.Response:
    """One call on a new connection (so that the kernel may hand it to either process); a process
    still warming up answers 503: retry it."""
    for _ in range(100):
        r = httpx.post(url + "/attention", content=body, timeout=60,
                       headers={"content-type": "application/x-safetensors"})
        if r.status_code != 503:
            return r
        time.sleep(0.1)
    return r


def success_count(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    series = 'attnserve_inference_request_success_total{kind="attention"}'
    line = next(x for x in text.splitlines() if x.startswith(series))
    return float(line.split()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_two_processes_share_the_ports_and_their_metrics(tmp_path):
    """Two CPU processes: calls over new HTTP connections and new gRPC channels are all answered
    right; new connections reach both processes; a second server cannot take the port; every
    scrape, whichever process answers it, counts every call; SIGTERM stops them all."""
    with run_server(tmp_path, "--processes", "2", "--warmup-shapes", "1x1x8x8") as srv:
        workers = children(srv.proc.pid)
        assert len(workers) == 2, srv.log()
        calls = 0
        g = torch.Generator().manual_seed(0)
        for i in range(16):
            q, k, v = (torch.randn(1, 2, 8 + i, 16, generator=g) for _ in range(3))
            r = post(srv.url, st.save({"q": q, "k": k, "v": v}))
            assert r.status_code == 200, r.text
            assert torch.allclose(st.load(r.content)["o"].double(), attention64(q, k, v)[0], atol=1e-5)
            calls += 1
        for _ in range(4):
            q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
            with GrpcAttentionClient(srv.grpc_target) as client:
                o = client.attention(q, k, v)
            assert torch.allclose(o.double(), attention64(q, k, v)[0], atol=1e-5)
            calls += 1
        # each process holds its own listening socket, the supervisor none: a process that exits takes
        # its socket out of the SO_REUSEPORT group (one kept by the supervisor hung the connections
        # the kernel still hashed to it during a drain)
        assert accepted([srv.proc.pid, *workers], srv.http_port, state="0A") == [0, 1, 1]
        # new connections spread over both processes (one SO_REUSEPORT socket each); held open at once
        clients = [httpx.Client(base_url=srv.url, timeout=60) for _ in range(24)]
        try:
            assert all(c.get("/healthz").status_code == 200 for c in clients)
            spread = accepted(workers, srv.http_port)
            assert sum(spread) == 24 and min(spread) > 0, spread
        finally:
            for c in clients:
                c.close()
        # a second server on the same port fails to start instead of sharing it
        with run_server(tmp_path, "--processes", "2", "--http-port", str(srv.http_port), wait_ready=False) as other:
            assert other.proc.wait(timeout=60) == 1 and "cannot bind HTTP" in other.log(), other.log()
        time.sleep(1.5)  # both processes' counters are in their files at once; gauges within 1 s
        assert [success_count(srv.url) for _ in range(8)] == [calls] * 8, srv.log()
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "attnserve_ready 1.0" in text.splitlines()  # every process ready (livemin)
        assert "attnserve_inference_pending_requests 0.0" in text.splitlines()  # summed: nothing held
        assert "[" in srv.log() and "processes serving HTTP" in srv.log()
        # GET /sessions asks every process (the union): one client call is one request in the metrics
        for _ in range(5):
            assert httpx.get(srv.url + "/sessions", timeout=30).status_code == 200
        series = 'attnserve_http_requests_total{method="GET",route="/sessions",status="200"}'
        lines = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
        assert [float(x.split()[-1]) for x in lines if x.startswith(series)] == [5.0], lines
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        assert not any(os.path.exists(f"/proc/{p}") for p in workers)  # drained, exited, reaped


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_process_that_dies_stops_the_others(tmp_path):
    """If one process exits by itself, the supervisor stops the rest and exits non-zero (so that
    an orchestrator restarts the whole server)."""
    with run_server(tmp_path, "--processes", "2", "--warmup-shapes", "1x1x8x8") as srv:
        first, second = children(srv.proc.pid)
        os.kill(first, signal.SIGKILL)
        assert srv.proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{second}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{second}"), "the other process was left running"
        assert "exited with code" in srv.log()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_processes_stop_when_their_supervisor_is_killed(tmp_path):
    """SIGKILL of the supervisor (no chance to forward anything): its processes get SIGTERM from
    the kernel and exit (they once kept serving the ports, and a restart could not bind them). Its
    private folders stay; the next supervisor on the host removes them."""
    tmp = tempfile.mkdtemp(prefix="as-")  # short: the peers' socket paths must fit AF_UNIX's 108 bytes
    try:
        with run_server(tmp_path, "--processes", "2", "--warmup-shapes", "1x1x8x8", env={"TMPDIR": tmp}) as srv:
            workers = children(srv.proc.pid)
            assert len(workers) == 2, srv.log()
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(timeout=10)
            deadline = time.monotonic() + 60
            while any(alive(p) for p in workers) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not any(alive(p) for p in workers), srv.log()
        ours = ("attnserve-metrics-", "attnserve-peers-")
        assert len([f for f in os.listdir(tmp) if f.startswith(ours)]) == 2  # the supervisor could not remove them
        # the next supervisor removes those of supervisors that are gone, not a live one's (this process's)
        live = os.path.basename(tempfile.mkdtemp(prefix=f"attnserve-peers-{os.getpid()}-", dir=tmp))
        with run_server(tmp_path, "--processes", "2", "--warmup-shapes", "1x1x8x8", env={"TMPDIR": tmp}) as srv:
            found = sorted(f for f in os.listdir(tmp) if f.startswith(ours))
            new = sorted(f for f in found if f"-{srv.proc.pid}-" in f)
            assert len(new) == 2 and found == sorted([live, *new]), found
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sampled_gauges_reach_the_shared_metrics(tmp_path):
    """Under --processes a gauge read from a callable is set by ``refresh`` (a process cannot call
    another's callables), and ``render`` reads every process's files."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "from service.core.metrics import Metrics, render\n"
        "m = Metrics()\n"
        "m.track_queue(lambda: 7, lambda: 9)\n"
        "before = render(m.registry).decode()\n"
        "m.refresh()\n"
        "after = render(m.registry).decode()\n"
        "print('queue_depth 7.0' in before, 'attnserve_inference_queue_depth 7.0' in after,"
        " 'attnserve_inference_pending_requests 9.0' in after)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


def test_supervisor_start_up_errors(tmp_path):
    """A busy HTTP port (exit 1) and a bad --device (exit 2) stop the supervisor before it starts
    any process, with a message that says which."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with run_server(tmp_path, "--processes", "2", "--http-port", str(port), wait_ready=False) as srv:
            assert srv.proc.wait(timeout=60) == 1
            assert "cannot bind HTTP" in srv.log() and "process 0" not in srv.log()
    with run_server(tmp_path, "--processes", "2", "--device", "tpu:0", wait_ready=False) as srv:
        assert srv.proc.wait(timeout=60) == 2
        assert "--device" in srv.log() and "process 0" not in srv.log()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_one_process_per_gpu(tmp_path):
    """--processes 2 on two GPUs: one process on each, both in the shared metrics, answers right."""
    with run_server(tmp_path, "--processes", "2", "--device", "cuda", "--warmup-shapes", "1x8x128x64",
                    timeout=600) as srv:
        log = srv.log()
        assert "on cuda:0" in log and "on cuda:1" in log, log
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            q, k, v = (torch.randn(1, 8, 128, 64, generator=g).half() for _ in range(3))
            r = post(srv.url, st.save({"q": q, "k": k, "v": v}))
            assert r.status_code == 200, r.text
            o = st.load(r.content)["o"].double()
            assert (o - attention64(q.double(), k.double(), v.double())[0]).abs().max() < 2e-3
        time.sleep(1.5)  # the sampled gauges are set every second
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        for d in ("cuda:0", "cuda:1"):
            assert f'attnserve_gpu_memory_total_bytes{{device="{d}"}}' in text, text[-2000:]
