"""Hostile clients at the HTTP server's edge, and abandoned work, against a real CPU server (raw
sockets): a URL too long (414), request heads too large or with too many fields (431: the
server's memory stays bounded), heads and bodies that stop arriving (408), unparsable requests
(JSON 400); a client that hangs up, or a gRPC call cancelled, while its request waits in the
batcher or a session step waits for its launch (dropped unlaunched, nothing appended, counted in
attnserve_requests_cancelled_total). In-process, with
the kernel gated (tests/service/test_batcher.py's Gate): a request cancelled or expired while staged
behind a running launch is skipped, and the launch counters count only requests launched.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import grpc
import httpx
import orjson
import pytest
import torch
from conftest import run_server
from test_batcher import OPTIONS, SHAPES, Gate, batch_sizes, make_request, started_engine

import kernels
from service import errors
from service.grpc.protogen import attention_stubs

apb = attention_stubs().attention_pb2
apb_grpc = attention_stubs().attention_pb2_grpc

ST = "application/x-safetensors"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("hostile-ops"), "--warmup-shapes", "1x1x16x16",
                    "--warmup-dtypes", "float32", "--max-body-mb", "64", "--max-header-kb", "16",
                    "--header-timeout-s", "1", "--body-timeout-s", "1", "--max-queue-delay-ms", "60000") as s:
        yield s


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.http_port))
    s.settimeout(10)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def answer(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, orjson.loads(body)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def metric(server, name: str, **labels) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{", 1)[0] == name and all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


def assert_serving(server) -> None:
    g = torch.Generator().manual_seed(1)
    t = {n: torch.randn(1, 2, 3, 4, generator=g) for n in "qkv"}
    r = httpx.post(server.url + "/attention", json={n: x.tolist() for n, x in t.items()}, timeout=30)
    assert r.status_code == 200, r.text
    want = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"])
    assert torch.allclose(torch.tensor(r.json()["o"]), want, atol=1e-5)


# ---------------------------------------------------------------- 5. the URL


@pytest.mark.parametrize("path", ["/healthz", "/v2/health/live", "/attention"])
def test_a_url_too_long_gets_414_with_the_routes_json_error(server, path):
    s = connect(server)
    s.sendall(f"GET {path}?x={'a' * 65536} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    status, body = answer(read_all(s))
    assert status == 414
    text = body["error"] if path.startswith("/v2") else body["error"]["message"]
    assert "--max-url-kb" in text
    if not path.startswith("/v2"):
        assert body["error"]["code"] == "uri_too_long"


def test_unparsable_requests_get_a_json_400(server):
    for raw in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n"):
        s = connect(server)
        s.sendall(raw)
        status, body = answer(read_all(s))
        assert status == 400 and body["error"]["code"] == "bad_request"


def test_bytes_past_a_body_are_answered_after_it(server):
    """Bytes after a body (a body longer than its Content-Length) are the next pipelined request;
    when they do not parse, the request before them is still answered, then a JSON 400 comes and
    the connection closes. With a valid request pipelined between them, both are answered first."""
    g = torch.Generator().manual_seed(2)
    t = {n: torch.randn(1, 2, 3, 4, generator=g) for n in "qkv"}
    body = _safetensors(t)
    want = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"])
    request = (f"POST /attention HTTP/1.1\r\nHost: t\r\nContent-Type: {ST}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    for between in (0, 1):
        s = connect(server)
        s.sendall(request * (1 + between) + b"\x00garbage\r\n\r\n")
        raw, answers = read_all(s), []
        while raw:  # each response: its head, then content-length bytes
            head, _, rest = raw.partition(b"\r\n\r\n")
            n = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")).split(b":")[1])
            answers.append((head, rest[:n]))
            raw = rest[n:]
        assert [h.split(b" ", 2)[1] for h, _ in answers] == [b"200"] * (1 + between) + [b"400"], answers
        for _, payload in answers[:-1]:
            got = torch.frombuffer(bytearray(payload[-want.numel() * 4:]), dtype=torch.float32).view_as(want)
            assert torch.allclose(got, want, atol=1e-5)
        status, err = answer(b"\r\n\r\n".join(answers[-1]))
        assert status == 400 and err["error"]["code"] == "bad_request"
    assert_serving(server)


# ---------------------------------------------------------------- 6. heads, bodies, timeouts


def test_unfinished_huge_headers_keep_the_server_small(server):
    """Four connections each sending an endless header field: each gets 431 once it passes
    --max-header-kb, and the server's RSS does not grow by what they sent."""
    before = rss_kib(server.proc.pid)

    def flood(out: list):
        s = connect(server)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")
        sent = 0
        try:
            while sent < 64 << 20:
                s.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        out.append((sent, read_all(s)))

    results: list = []
    threads = [threading.Thread(target=flood, args=(results,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    grown = rss_kib(server.proc.pid) - before
    assert grown < 32 * 1024, f"the server grew by {grown} KiB"
    for sent, raw in results:
        assert sent < 64 << 20
        if raw:  # the answer may be lost to the reset of a socket with unread data
            status, body = answer(raw)
            assert status == 431 and "--max-header-kb" in body["error"]["message"]
    assert_serving(server)


def test_too_many_header_fields_get_431(server):
    s = connect(server)
    fields = b"".join(b"X-%d: 1\r\n" % i for i in range(150))
    s.sendall(b"GET /v2 HTTP/1.1\r\nHost: t\r\n" + fields + b"\r\n")
    status, body = answer(read_all(s))
    assert status == 431 and "--max-headers" in body["error"]


@pytest.mark.parametrize("sent", [b"", b"GET /heal", b"GET /healthz HTTP/1.1\r\nHost: t\r\n"])
def test_a_head_that_stops_arriving_gets_408(server, sent):
    s = connect(server)
    s.sendall(sent)
    t0 = time.monotonic()
    status, body = answer(read_all(s))
    assert status == 408 and "--header-timeout-s" in body["error"]["message"]
    assert 0.9 < time.monotonic() - t0 < 5


@pytest.mark.parametrize("kind", ["json", "direct read"])
def test_a_body_that_stops_arriving_gets_408(server, kind):
    if kind == "json":
        head = b"POST /attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        part = b'{"q": '
    else:  # >= 1 MiB with a Content-Length: read straight into one buffer (uvicorn_patch)
        head = b"POST /attention HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            ST.encode(), 4 << 20)
        part = bytes(200_000)
    s = connect(server)
    s.sendall(head + part)
    t0 = time.monotonic()
    status, body = answer(read_all(s))
    assert status == 408 and "--body-timeout-s" in body["error"]["message"]
    assert 0.9 < time.monotonic() - t0 < 5
    assert_serving(server)


def test_a_slow_but_steady_body_is_served(server):
    """A body that keeps coming, slower than the body timeout in total, is not dropped; nor is a
    keep-alive connection between requests."""
    g = torch.Generator().manual_seed(2)
    t = {n: torch.randn(1, 2, 3, 4, generator=g) for n in "qkv"}
    body = orjson.dumps({n: x.tolist() for n, x in t.items()})
    s = connect(server)
    s.sendall(b"POST /attention HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    pieces = [body[i:i + len(body) // 5 + 1] for i in range(0, len(body), len(body) // 5 + 1)]
    for piece in pieces:
        time.sleep(0.4)  # 2 s in all, over the 1 s body timeout
        s.sendall(piece)
    time.sleep(0.5)  # idle between requests: the keep-alive timeout applies, not ours
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    raw = read_all(s)
    assert raw.count(b"HTTP/1.1 200 OK") == 2, raw[:300]


# ---------------------------------------------------------------- 7. abandoned requests


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    header, data = {}, b""
    for name, x in tensors.items():
        b = x.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(x.shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    head = orjson.dumps(header)
    return struct.pack("<Q", len(head)) + head + data


def _busy(server) -> threading.Thread:
    """A long request (seconds on a CPU) that keeps the one worker busy; returns once it runs."""
    g = torch.Generator().manual_seed(0)
    body = _safetensors({n: torch.randn(1, 8, 8192, 64, generator=g) for n in "qkv"})
    done: list = []
    thread = threading.Thread(target=lambda: done.append(
        httpx.post(server.url + "/attention", content=body, headers={"content-type": ST}, timeout=120)))
    thread.done = done  # type: ignore[attr-defined]
    thread.start()
    for _ in range(600):
        if metric(server, "attnserve_inference_pending_requests") >= 1:
            return thread
        time.sleep(0.02)
    raise AssertionError("the long request never ran")


def _wait_queued(server, n: float) -> None:
    for _ in range(300):
        if metric(server, "attnserve_inference_queue_depth") == n:
            return
        time.sleep(0.02)
    raise AssertionError(f"queue depth never reached {n}")


def _small() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(1, 1, 8, 16, generator=g) for n in "qkv"}


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_an_abandoned_request_is_not_launched(server, transport):
    launches = metric(server, "attnserve_inference_exec_total")
    cancelled = metric(server, "attnserve_requests_cancelled_total", stage="queued")
    busy = _busy(server)
    if transport == "http":
        body = _safetensors(_small())
        s = connect(server)
        s.sendall(b"POST /attention HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                  % (ST.encode(), len(body)) + body)
        _wait_queued(server, 1)
        s.close()  # the client hangs up
    else:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = apb_grpc.AttentionServiceStub(channel)
            msg = apb.AttendRequest(**{n: apb.Tensor(shape=list(x.shape), dtype=apb.FLOAT32, data=x.numpy().tobytes())
                                       for n, x in _small().items()})
            call = stub.Attend.future(msg, timeout=60)
            _wait_queued(server, 1)
            call.cancel()
    _wait_queued(server, 0)  # dropped from the queue while the long request still runs
    assert busy.is_alive()
    busy.join(120)
    assert busy.done[0].status_code == 200  # type: ignore[attr-defined]
    time.sleep(0.3)
    assert metric(server, "attnserve_requests_cancelled_total", stage="queued") == cancelled + 1
    assert metric(server, "attnserve_inference_exec_total") == launches + 1  # the long request only
    assert metric(server, "attnserve_inference_pending_requests") == 0
    if transport == "http":
        assert metric(server, "attnserve_http_requests_total", route="/attention", status="499") >= 1
    assert_serving(server)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_an_abandoned_session_step_is_not_launched_and_appends_nothing(server, transport):
    """A session step queued behind a long launch, whose client hangs up (HTTP) or cancels (gRPC):
    it leaves the queue unlaunched, the session keeps its length, the cancellation is counted, and
    the next step of that session is served."""
    r = httpx.post(server.url + "/sessions", json={"layers": 1, "num_kv_heads": 1, "head_dim": 16,
                                                   "dtype": "float32"}, timeout=30)
    assert r.status_code == 201, r.text
    sid = r.json()["session"]
    cancelled = metric(server, "attnserve_requests_cancelled_total", kind="session", stage="queued")
    tensors = _small()
    busy = _busy(server)
    if transport == "http":
        body = _safetensors(tensors)
        s = connect(server)
        s.sendall(b"POST /sessions/%s/attend HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\n"
                  b"Content-Length: %d\r\n\r\n" % (sid.encode(), ST.encode(), len(body)) + body)
        _wait_steps_queued(server, 1)
        s.close()  # the client hangs up
    else:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = apb_grpc.AttentionServiceStub(channel)
            msg = apb.SessionAttendRequest(sessions=[sid], **{
                n: apb.Tensor(shape=list(x.shape), dtype=apb.FLOAT32, data=x.numpy().tobytes())
                for n, x in tensors.items()})
            call = stub.SessionAttend.future(msg, timeout=60)
            _wait_steps_queued(server, 1)
            call.cancel()
    _wait_steps_queued(server, 0)  # dropped while the long request still runs
    assert busy.is_alive()
    busy.join(120)
    assert metric(server, "attnserve_requests_cancelled_total", kind="session", stage="queued") == cancelled + 1
    assert httpx.get(f"{server.url}/sessions/{sid}", timeout=30).json()["lengths"] == [0]
    r = httpx.post(f"{server.url}/sessions/{sid}/attend", content=_safetensors(tensors),
                   headers={"content-type": ST}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/sessions/{sid}", timeout=30).json()["lengths"] == [8]
    assert httpx.delete(f"{server.url}/sessions/{sid}", timeout=30).status_code in (200, 204)
    assert_serving(server)


def _wait_steps_queued(server, n: float) -> None:
    for _ in range(300):
        if metric(server, "attnserve_session_queue_depth") == n:
            return
        time.sleep(0.02)
    raise AssertionError(f"session queue depth never reached {n}")


# ---------------------------------------------------------------- 7, 8: in-process, gated kernel


@pytest.fixture
def gate(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU path, as in tests/service/test_batcher.py

    def install(**kw) -> Gate:
        g = Gate(kernels.attention, **kw)
        monkeypatch.setattr(kernels, "attention", g)
        return g

    return install


@pytest.mark.parametrize("how", ["expired", "cancelled"])
def test_a_request_staged_behind_a_launch_is_skipped_and_not_counted(gate, how):
    """B is staged behind the running launch of A (no batching delay), then expires or its caller
    goes away: the worker skips it, and neither the launch counter nor the batch-size histogram
    counts a launch for it."""

    async def main():
        async with started_engine("--max-queue-delay-ms", "0") as engine:
            g = gate(hold=True)
            a = asyncio.create_task(engine.attend(make_request(SHAPES[0], OPTIONS[0], seed=0)))
            await g.wait_entered()
            b_req = make_request(SHAPES[1], OPTIONS[0], seed=1)
            if how == "expired":
                b_req.deadline = time.monotonic() + 0.1
            b = asyncio.create_task(engine.attend(b_req))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if engine.workers[0].inflight == 2:
                    break
            assert engine.workers[0].inflight == 2  # B is staged
            if how == "expired":
                with pytest.raises(errors.DeadlineExceeded):
                    await b
            else:
                b.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await b
            g.opened.set()
            await a
            for _ in range(100):  # B's (empty) launch settles
                if engine.workers[0].inflight == 0:
                    break
                await asyncio.sleep(0.01)
            reg = engine.metrics_registry
            cancelled = reg.get_sample_value("attnserve_requests_cancelled_total",
                                             {"kind": "attention", "stage": "launched"}) or 0
            execs = reg.get_sample_value("attnserve_inference_exec_total", {"device": "cpu"})
            return batch_sizes(engine), execs, cancelled, [tuple(q.shape) for q in g.launches], engine.batcher.held

    (launches, requests), execs, cancelled, shapes, held = asyncio.run(main())
    assert (launches, requests, execs) == (1, 1, 1)
    assert shapes == [(1, 4, 16, 32)]  # B's q never reached the kernel
    assert cancelled == (1 if how == "cancelled" else 0)
    assert held == 0


def test_a_cancelled_queued_request_leaves_the_queue(gate):
    async def main():
        async with started_engine("--max-queue-delay-ms", "60000") as engine:
            g = gate(hold=True)
            a = asyncio.create_task(engine.attend(make_request(SHAPES[0], OPTIONS[0], seed=0)))
            await g.wait_entered()
            b = asyncio.create_task(engine.attend(make_request(SHAPES[1], OPTIONS[0], seed=1)))
            await asyncio.sleep(0.05)
            queued = engine.batcher._queued
            b.cancel()
            with pytest.raises(asyncio.CancelledError):
                await b
            after = engine.batcher._queued, engine.batcher.held
            g.opened.set()
            await a
            reg = engine.metrics_registry
            return queued, after, batch_sizes(engine), reg.get_sample_value(
                "attnserve_requests_cancelled_total", {"kind": "attention", "stage": "queued"})

    queued, after, sizes, cancelled = asyncio.run(main())
    assert queued == 1 and after == (0, 1)
    assert sizes == (1, 1) and cancelled == 1
