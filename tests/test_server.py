"""Start-up of the real process: configuration errors stop it before any port is bound."""

from __future__ import annotations

import socket

import httpx

from tests.conftest import FAST, run_server


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


def test_busy_http_port_stops_the_process(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with run_server(tmp_path, "--http-port", str(port), wait_ready=False) as server:
            assert server.proc.wait(timeout=90) == 1
            assert "HTTP server stopped" in server.log()


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


def test_glibc_keeps_big_freed_blocks(tmp_path):
    """The server asks glibc to reuse big freed blocks (request bodies) instead of unmapping them;
    a 24 MiB body then goes through, twice, with the right answer."""
    import platform

    import torch
    from safetensors.torch import load, save

    from service.server import reuse_freed_memory

    if platform.libc_ver()[0] == "glibc":
        assert reuse_freed_memory(64 << 20) is True
    q = torch.randn(1, 2, 1, 64)
    k = torch.randn(1, 2, 49152, 64)  # k and v: 24 MiB in float32
    v = torch.full_like(k, 0.5)  # o = 0.5 whatever the weights
    body = save({"q": q, "k": k, "v": v})
    with run_server(tmp_path) as srv:
        for _ in range(2):
            r = httpx.post(srv.url + "/attention", content=body, timeout=120,
                           headers={"content-type": "application/x-safetensors"})
            assert r.status_code == 200, r.text
            assert torch.allclose(load(r.content)["o"], torch.full((1, 2, 1, 64), 0.5))


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


def test_http_connections_read_big_chunks():
    """The HTTP protocol the server runs (``http_protocol``) makes each connection's socket reads
    1 MiB: a big body then costs the loop 4x fewer callbacks than asyncio's 256 KiB reads."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from service.server import READ_CHUNK_BYTES, http_protocol

    async def app(scope, receive, send):  # never reached: the test only connects
        raise AssertionError

    async def main() -> int:
        config = uvicorn.Config(app, http=http_protocol(), lifespan="off", log_level="error")
        config.load()
        state = ServerState()
        server = await asyncio.get_running_loop().create_server(
            lambda: config.http_protocol_class(config=config, server_state=state, app_state={}), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if state.connections:
                break
            await asyncio.sleep(0.01)
        (conn,) = state.connections
        size = conn.transport.max_size
        writer.close()
        server.close()
        return size

    assert asyncio.run(main()) == READ_CHUNK_BYTES
