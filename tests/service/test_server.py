"""The server process: start-up and configuration errors (stopped before any port is bound), its HTTP
protocol (bodies gathered, bodies read straight into one buffer), keep-alive, the access log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.conftest import FAST, ROOT, free_port, run_server


def test_broken_layer_stops_startup_with_a_clear_message(tmp_path):
    with run_server(tmp_path, "--layer", "x=/nonexistent/ckpt:0", wait_ready=False) as server:
        assert server.proc.wait(timeout=60) == 2
        log = server.log()
        assert "checkpoint folder /nonexistent/ckpt does not exist" in log
        assert "Traceback" not in log


def test_bad_device_stops_startup(tmp_path):
    with run_server(tmp_path, "--device", "tpu:0", wait_ready=False) as server:
        assert server.proc.wait(timeout=60) == 2
        assert "--device" in server.log()


@pytest.mark.parametrize(("flag", "message"), [
    ("--http-port", "cannot bind HTTP 127.0.0.1:{port}: Address already in use"),
    ("--grpc-port", "cannot bind gRPC 127.0.0.1:{port}: Address already in use"),  # once a traceback
])
def test_a_busy_port_stops_the_process_with_the_reason(tmp_path, flag, message):
    """One line that says which port and why, before the warm-up (exit 1: the host's state, as the
    supervisor of --processes answers it; uvicorn's and grpc-core's own lines said it twice)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with run_server(tmp_path, flag, str(port), wait_ready=False) as server:
            assert server.proc.wait(timeout=90) == 1
            log = server.log()
            assert message.format(port=port) in log, log
            assert "Traceback" not in log and "warm" not in log and "Errno 98" not in log, log


@contextlib.contextmanager
def _taken_port(how: str) -> Iterator[int]:
    """A port another process (here, this one) listens on: "http"/"grpc" a plain listener (the server
    cannot bind it), "http-answered" one that answers every GET with 200 (another suite's server,
    ready), "grpc-shared" one with SO_REUSEPORT (grpc binds beside it, and the two share its calls)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if how == "http-answered":
        class Ready(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        with ThreadingHTTPServer(("127.0.0.1", 0), Ready) as other:
            threading.Thread(target=other.serve_forever, daemon=True).start()
            try:
                yield other.server_address[1]
            finally:
                other.shutdown()
        return
    with socket.socket() as busy:
        if how == "grpc-shared":
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_a_second_server_cannot_share_the_grpc_port(tmp_path):
    """grpc binds with SO_REUSEPORT unless told not to: a second server (here without the first's
    API key) once shared the port, and channels landed on either server."""
    with run_server(tmp_path, "--api-key", "k", "--warmup-shapes", "1x1x8x8") as first, \
            run_server(tmp_path, "--grpc-port", str(first.grpc_port), wait_ready=False) as second:
        assert second.proc.wait(timeout=90) == 1
        assert "cannot bind gRPC" in second.log(), second.log()


def test_a_stop_while_warming_up_does_not_wait_for_the_warm_up(tmp_path):
    """SIGTERM while the workers warm up (made to take 120 s here): the process exits at once,
    not after the warm-up (a cold GPU warm-up takes minutes, past an orchestrator's grace)."""
    http, grpc_port = free_port(), free_port()
    slow = ("import sys, time, runpy, kernels\n"
            "warmup = kernels.warmup\n"
            "kernels.warmup = lambda *a, **k: (time.sleep(120), warmup(*a, **k))[1]\n"
            "sys.argv = ['service'] + sys.argv[1:]\n"
            "runpy.run_module('service', run_name='__main__')\n")
    log_path = tmp_path / "slow.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNSERVE_", "TRITON_INTERPRET"))}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", slow, "--device", "cpu", "--host", "127.0.0.1",
                                 "--http-port", str(http), "--grpc-port", str(grpc_port)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "gRPC listening" not in log_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{http}/readyz", timeout=10).status_code == 503  # still warming
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert "stopped while warming up" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("lost", ["http", "grpc", "http-answered", "grpc-shared"])
def test_a_server_that_lost_its_port_is_started_again(tmp_path, monkeypatch, lost):
    """run_server's ports are free when chosen, but another process may bind one before the server
    has started (seconds later): the server exits, or the other process answers /readyz in its stead,
    or shares the gRPC port; run_server starts it again on new ports."""
    import tests.conftest as cf

    with _taken_port(lost) as taken:
        first = [taken, cf.free_port()] if lost.startswith("http") else [cf.free_port(), taken]
        real, picks = cf.free_port, iter(first)
        monkeypatch.setattr(cf, "free_port", lambda: next(picks, None) or real())
        with cf.run_server(tmp_path) as server:
            assert taken not in (server.http_port, server.grpc_port)
            assert httpx.get(server.url + "/healthz").status_code == 200
        logs = sorted(tmp_path.glob("server-*.log"))
        assert len(logs) == 2, logs


def test_server_serves_then_stops_cleanly_on_sigterm(tmp_path):
    with run_server(tmp_path) as server:
        assert httpx.get(server.url + "/healthz").status_code == 200
        server.proc.terminate()
        assert server.proc.wait(timeout=60) == 0
        assert "stopped" in server.log()


def test_bad_option_values_are_a_usage_error(tmp_path):
    with run_server(tmp_path, "--max-queue-size", "0", "--memory-fraction", "1.5", wait_ready=False) as server:
        assert server.proc.wait(timeout=60) == 2
        log = server.log()
        assert "--max-queue-size: Input should be greater than 0" in log
        assert "--memory-fraction" in log and "Traceback" not in log


def _big_safetensors_request() -> tuple[bytes, torch.Tensor, float]:
    """A 48 MiB safetensors body (k and v: 24 MiB each in float32, drawn from a seeded generator),
    its float64 answer, and the error budget of its float32 answer: 2x plain PyTorch's error in
    float32 plus a hair (STYLE.md 11). Over 49152 keys, float32 sums are off by ~1e-6 whatever the
    summation order: an exact-value check at allclose's default tolerance failed for about one in
    200 unseeded draws."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 64, generator=g)
    k = torch.randn(1, 2, 49152, 64, generator=g)
    v = torch.randn(1, 2, 49152, 64, generator=g)
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8.0, dim=-1) @ v.double()
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    budget = 2 * (plain.double() - ref).abs().max().item() + 1e-6 * ref.abs().max().item()
    return save({"q": q, "k": k, "v": v}), ref, budget


def _post_twice(url: str, body: bytes, ref: torch.Tensor, budget: float) -> torch.Tensor:
    """POST ``body`` to /attention twice: both answers equal, and within ``budget`` of ``ref``."""
    from safetensors.torch import load

    answers = []
    for _ in range(2):
        r = httpx.post(url + "/attention", content=body, timeout=120,
                       headers={"content-type": "application/x-safetensors"})
        assert r.status_code == 200, r.text
        answers.append(load(r.content)["o"])
    assert torch.equal(answers[0], answers[1])
    err = (answers[0].double() - ref).abs().max().item()
    assert err <= budget, f"max error {err:.3g} over budget {budget:.3g}"
    return answers[0]


def test_glibc_keeps_big_freed_blocks(tmp_path):
    """The server asks glibc to reuse big freed blocks (request bodies) instead of unmapping them
    (glibc takes the values: checked in a process of its own, so that this one's allocator is left
    alone); a 48 MiB body then goes through, twice, with the right answer."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] == "glibc":
        probe = subprocess.run(
            [sys.executable, "-c", "from service.allocator import reuse_freed_memory as r; print(r(64 << 20))"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
        assert probe.stdout.strip() == "True", probe.stderr
    body, ref, budget = _big_safetensors_request()
    with run_server(tmp_path) as srv:
        _post_twice(srv.url, body, ref, budget)


def test_allocator_off_switch_leaves_glibc_alone(monkeypatch):
    """--no-tune-allocator (or ATTNSERVE_TUNE_ALLOCATOR=0): mallopt is never called; on (the
    default): the three parameters service/allocator.py names, with --max-body-mb's size."""
    from service import allocator
    from service.settings import load_settings

    calls: list[tuple[int, int]] = []

    class Glibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(allocator, "_glibc", Glibc)
    monkeypatch.delenv("ATTNSERVE_TUNE_ALLOCATOR", raising=False)
    assert allocator.install(load_settings(["--no-tune-allocator"])) is False
    monkeypatch.setenv("ATTNSERVE_TUNE_ALLOCATOR", "0")
    assert allocator.install(load_settings([])) is False
    assert calls == []
    monkeypatch.delenv("ATTNSERVE_TUNE_ALLOCATOR")
    assert allocator.install(load_settings(["--max-body-mb", "64"])) is True
    size = 64 << 20
    assert calls == [(allocator.M_ARENA_MAX, 1), (allocator.M_MMAP_THRESHOLD, size), (allocator.M_TRIM_THRESHOLD, size)]


def test_big_body_answer_is_the_same_with_the_patches_off(tmp_path):
    """A big safetensors POST through uvicorn's own protocol and glibc's own allocator
    (--no-patch-uvicorn --no-tune-allocator) gets the very answer it gets through the patches."""
    body, ref, budget = _big_safetensors_request()
    answers = []
    for flags in ((), ("--no-patch-uvicorn", "--no-tune-allocator")):
        with run_server(tmp_path, *FAST, *flags) as srv:
            answers.append(_post_twice(srv.url, body, ref, budget))
            log = srv.log()
        assert ("uvicorn's own HTTP protocol" in log) == bool(flags)
    assert torch.equal(answers[0], answers[1])


def test_idle_server_gives_big_freed_blocks_back(tmp_path):
    """Freed request bodies are kept for reuse while requests come (above), and handed back to the
    OS once the server has been idle for a while: its RSS falls back after a burst of big bodies."""
    import platform
    import time

    import pytest
    import torch
    from safetensors.torch import save

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")

    def rss(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    q = torch.randn(1, 1, 1, 16)
    k = torch.randn(1, 1, 1 << 19, 16)  # k and v: 32 MiB each in float32
    body = save({"q": q, "k": k, "v": k.clone()})
    del k
    with run_server(tmp_path, "--memory-trim-idle-s", "4", *FAST) as srv:
        pid = srv.proc.pid
        before = rss(pid)
        for _ in range(2):
            r = httpx.post(srv.url + "/attention", content=body, timeout=300,
                           headers={"content-type": "application/x-safetensors"})
            assert r.status_code == 200, r.text
        kept = rss(pid) - before
        assert kept > 48 << 20, f"the 64 MiB body was not kept for reuse ({kept >> 20} MiB)"
        deadline = time.monotonic() + 30
        while rss(pid) - before > 16 << 20 and time.monotonic() < deadline:
            time.sleep(0.5)
        after = rss(pid) - before
    assert after < 16 << 20, f"{kept >> 20} MiB kept after two 64 MiB bodies, still {after >> 20} MiB idle"


def test_bad_http_fd_stops_startup(tmp_path):
    """--http-fd (what --processes gives its processes) naming no socket, or one that does not
    listen, stops the process with exit code 2 and says why."""
    with run_server(tmp_path, "--http-fd", "987", wait_ready=False) as server:
        assert server.proc.wait(timeout=60) == 2
        assert "--http-fd 987: not an open socket" in server.log() and "Traceback" not in server.log()


@contextlib.contextmanager
def _uvicorn(app, protocol) -> Iterator[int]:
    """uvicorn serving ``app`` with ``protocol`` in a thread of this process: yields its port."""
    import asyncio
    import threading

    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, port=port, http=protocol, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        for _ in range(1000):  # up to 20 s on a loaded CI machine
            if server.started:
                break
            threading.Event().wait(0.02)
        assert server.started, "uvicorn did not start"
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


async def _receive_all(receive) -> tuple[list, bool]:
    """(the body of every http.request message, whether the client disconnected)."""
    pieces = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return pieces, True
        pieces.append(message["body"])
        if not message["more_body"]:
            return pieces, False


def test_a_body_wakes_the_app_once_per_gathered_piece():
    """The server's HTTP protocol (``http_protocol``) hands a body to the app whole, or in pieces of
    ``gather_bytes``, however the socket delivers it: uvicorn alone woke the app for every read."""
    import uvicorn

    from service.http.uvicorn_patch import UVICORN_HANDING_OVER, hand_over_request_bodies, http_protocol

    if uvicorn.__version__ != UVICORN_HANDING_OVER:
        assert http_protocol(1 << 20) == "httptools"
        return
    hand_over_request_bodies()
    body = bytes(range(256)) * (16 << 12)  # 4 MiB

    def pieces_of_one_call(gather_bytes: int) -> int:
        got: list[int] = []

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            pieces, _ = await _receive_all(receive)
            got.append(len(pieces) if b"".join(pieces) == body else -1)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        with _uvicorn(app, http_protocol(gather_bytes)) as port:
            def chunks():  # many small writes, chunked encoding: the server's reads see small pieces
                for i in range(0, len(body), 64 << 10):
                    yield body[i : i + (64 << 10)]

            r = httpx.post(f"http://127.0.0.1:{port}/", content=chunks(), timeout=30)
            assert r.status_code == 200
        (n,) = got
        return n

    assert pieces_of_one_call(64 << 20) == 1  # the whole body at once
    assert pieces_of_one_call(1 << 20) >= 4  # at least every MiB


def test_a_big_declared_body_is_read_straight_into_one_buffer():
    """A body with a Content-Length of at least DIRECT_READ_MIN_BYTES is read into one buffer from
    the allocator and handed to the app as it is (one copy, the kernel's), however it arrives: with
    its headers or after them, in small writes, after a 100 Continue. The connection then parses
    the next request as usual; a client gone mid-body harms nobody else."""
    import hashlib

    import uvicorn

    from service.http.uvicorn_patch import (
        DIRECT_READ_MIN_BYTES,
        UVICORN_HANDING_OVER,
        hand_over_request_bodies,
        http_protocol,
    )

    if uvicorn.__version__ != UVICORN_HANDING_OVER:
        return
    hand_over_request_bodies()
    buffers: list[bytearray] = []
    disconnects: list[bool] = []

    def allocate(n: int) -> bytearray:
        buffers.append(bytearray(n))
        return buffers[-1]

    async def app(scope, receive, send):  # answers the sha256 of the body, and whether it was direct
        if scope["type"] != "http":
            return
        pieces, gone = await _receive_all(receive)
        if gone:
            disconnects.append(True)
            return
        data = b"".join(pieces)
        direct = len(pieces) == 1 and any(pieces[0] is b for b in buffers)
        answer = f"{hashlib.sha256(data).hexdigest()} {int(direct)}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    def call(s: socket.socket, body: bytes, split: int | None = 0, expect: bool = False,
             ctype: str = "application/x-safetensors") -> tuple[str, str]:
        """POST ``body`` on ``s``: headers and body in one write (split None), or the headers, then
        the body in writes of ``split`` bytes (0: one write); -> (sha256, direct flag)."""
        head = f"POST / HTTP/1.1\r\nHost: t\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n".encode()
        head += b"Expect: 100-continue\r\n\r\n" if expect else b"\r\n"
        if split is None:
            s.sendall(head + body)
        else:
            s.sendall(head)
            if expect:
                assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")
            step = split or len(body)
            for i in range(0, len(body), step):
                s.sendall(body[i : i + step])
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(4096)
        head_in, rest = data.split(b"\r\n\r\n", 1)
        length = int(head_in.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += s.recv(4096)
        digest, direct = rest.decode().split()
        return digest, direct

    big = bytes(range(251)) * (DIRECT_READ_MIN_BYTES // 251 * 3)  # ~3 MiB, not a multiple of any read
    small = b"x" * 1000
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    with _uvicorn(app, http_protocol(64 << 20, allocate)) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:  # one keep-alive connection
            assert call(s, big) == (sha(big), "1")
            assert call(s, small) == (sha(small), "0")  # parsed by a fresh parser
            assert call(s, big, split=None) == (sha(big), "1")  # headers and body in one write
            assert call(s, big, split=65536 + 7) == (sha(big), "1")
            assert call(s, big[: DIRECT_READ_MIN_BYTES - 1]) == (sha(big[: DIRECT_READ_MIN_BYTES - 1]), "0")
            assert call(s, big, expect=True) == (sha(big), "1")
            assert call(s, small, split=None) == (sha(small), "0")
            assert call(s, big, ctype="application/json") == (sha(big), "0")  # JSON: parsed as before
        with socket.create_connection(("127.0.0.1", port)) as gone:  # half a body, then away
            gone.sendall(f"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: {len(big)}\r\n\r\n".encode())
            gone.sendall(big[: len(big) // 2])
        with socket.create_connection(("127.0.0.1", port)) as s:
            assert call(s, big) == (sha(big), "1")
    assert len(buffers) == 6 and disconnects == [True]


def test_an_answer_goes_to_the_socket_in_one_write():
    """The server's HTTP protocol sends an answer's status line, headers and body parts with one
    ``writelines`` (uvloop sends each ``write`` at once: a syscall and a wake-up of the client each).
    Answers streamed over several turns of the loop still arrive whole and in order, pipelined
    requests are answered in turn, and a 100 Continue goes out before the answer starts."""
    import asyncio

    import uvicorn

    from service.http.uvicorn_patch import UVICORN_HANDING_OVER, hand_over_request_bodies, http_protocol

    if uvicorn.__version__ != UVICORN_HANDING_OVER:
        return
    hand_over_request_bodies()
    sends: list[tuple[str, int]] = []  # (method, bytes) of each call on the socket's transport

    class Counted:
        """The connection's transport, its writes counted."""

        def __init__(self, transport):
            self._transport = transport

        def write(self, data):
            sends.append(("write", len(data)))
            self._transport.write(data)

        def writelines(self, parts):
            parts = list(parts)
            sends.append(("writelines", sum(len(p) for p in parts)))
            self._transport.writelines(parts)

        def __getattr__(self, name):
            return getattr(self._transport, name)

    base = http_protocol(64 << 20)

    class Protocol(base):
        def connection_made(self, transport):
            super().connection_made(Counted(transport))

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await _receive_all(receive)
        parts = [b"a" * 100, b"b" * 70000, b"c" * 3]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(sum(map(len, parts))).encode())]})
        for i, part in enumerate(parts):
            if scope["path"] == "/stream":
                await asyncio.sleep(0.01)  # turns of the loop between the parts
            await send({"type": "http.response.body", "body": part, "more_body": i < 2})

    def answer(s: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        while len(body) < 70103:
            body += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and len(body) == 70103, (head, len(body))
        return body

    expected = b"a" * 100 + b"b" * 70000 + b"c" * 3
    with _uvicorn(app, Protocol) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert answer(s) == expected
        assert [m for m, _ in sends] == ["writelines"]
        sends.clear()
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        assert answer(s) == expected
        assert len(sends) >= 2  # each turn's pieces went out in their turn
        s.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\nGET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        assert answer(s) == expected and answer(s) == expected
        sends.clear()
        s.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(b"hello")
        assert answer(s) == expected
        assert [m for m, _ in sends] == ["write", "writelines"]


def test_idle_keep_alive_connections_stay_open(tmp_path):
    """An idle keep-alive connection outlives uvicorn's default 5 s (``--http-keep-alive-s``, 75 by
    default): a client that reuses it after a pause must not meet a connection the server is
    closing (Locust users building 128 MiB bodies on busy CPUs do). With
    ``--http-keep-alive-s 1`` the server closes it."""
    import time

    def response(s: socket.socket) -> bytes:
        """One whole response (headers, then Content-Length bytes of body): its status line."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(4096)
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += s.recv(4096)
        return head.split(b"\r\n", 1)[0]

    def idle_then_reuse(port: int, idle_s: float) -> bytes | None:
        """GET /healthz, stay idle, GET again on the same socket: the second status line, or
        None when the server closed the connection meanwhile."""
        with socket.create_connection(("127.0.0.1", port)) as s:
            request = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
            s.sendall(request)
            assert response(s) == b"HTTP/1.1 200 OK"
            time.sleep(idle_s)
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    return None  # closed by the server
            except BlockingIOError:
                pass
            s.setblocking(True)
            s.sendall(request)
            return response(s)

    with run_server(tmp_path, *FAST) as srv:
        assert idle_then_reuse(srv.http_port, 6.0) == b"HTTP/1.1 200 OK"
    with run_server(tmp_path, *FAST, "--http-keep-alive-s", "1") as srv:
        assert idle_then_reuse(srv.http_port, 2.5) is None


def test_access_log_is_off_unless_asked(tmp_path):
    """No line per request by default (it costs the event loop per call; /metrics counts requests
    by route and status); ``--access-log`` brings uvicorn's back."""
    line = '"GET /healthz?probe=1 HTTP/1.1" 200'
    with run_server(tmp_path, *FAST) as srv:
        assert httpx.get(srv.url + "/healthz?probe=1").status_code == 200
        srv.proc.terminate()
        srv.proc.wait(timeout=60)
        assert line not in srv.log()
    with run_server(tmp_path, *FAST, "--access-log") as srv:
        assert httpx.get(srv.url + "/healthz?probe=1").status_code == 200
        srv.proc.terminate()
        srv.proc.wait(timeout=60)
        assert line in srv.log()


@pytest.mark.gpu
def test_gpu_big_bodies_read_into_pinned_buffers_get_right_answers(tmp_path):
    """Over HTTP on a GPU: bodies of 3 MiB, the first read into the heap while a pinned buffer is
    made, the next ones into that buffer and sent to the GPU from it; every answer against the
    float64 reference, and a small call on the same connection in between."""
    import torch

    from service.client import AttentionClient
    from tests.helpers import attention64

    with run_server(tmp_path, "--device", "cuda:0", *FAST[:2], "--warmup-shapes", "1x8x1024x64",
                    "--warmup-dtypes", "float16") as srv, AttentionClient(srv.url) as client:
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(1, 8, 1024, 64, generator=g).half() for _ in range(3))  # 1 MiB each
            o = client.attention(q, k, v)
            assert (o.double() - attention64(q, k, v)[0]).abs().max() < 2e-3, seed
            small = client.attention(q[:, :, :16], k[:, :, :16], v[:, :, :16])
            assert (small.double() - attention64(q[:, :, :16], k[:, :, :16], v[:, :, :16])[0]).abs().max() < 2e-3


def test_body_buffers_without_pinned_memory_use_the_heap(caplog):
    """Where memory cannot be pinned (no CUDA here), the first big body goes to the heap, the
    failed attempt is logged once, and every later body goes to the heap without trying again."""
    import time

    import torch

    from service.http.uvicorn_patch import BodyBuffers

    if torch.cuda.is_available():
        pytest.skip("pinning works here")
    bodies = BodyBuffers(pinned=True, budget=64 << 20)
    first = bodies(3 << 20)
    assert isinstance(first, bytearray) and len(first) == 3 << 20
    for _ in range(500):
        if not bodies.pinned:
            break
        time.sleep(0.01)
    assert not bodies.pinned and bodies.pinned_bytes == 0
    assert isinstance(bodies(3 << 20), bytearray)
    assert sum("cannot pin" in r.getMessage() for r in caplog.records) == 1
