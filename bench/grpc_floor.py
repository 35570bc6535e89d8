"""gRPC's own floor on a host: what a call costs with no engine behind it.

    python -m bench.grpc_floor                 # every Python server kind, the Python client
    python -m bench.grpc_floor --iters 5000
    make -C bench/native && python -m bench.grpc_floor --native bench/native/build   # + C++ rows

An echo method (``grpcfloor.Echo/Echo``: a ``grpcfloor.Blob`` in, another back, its size named by the
request's first 4 bytes) served by ``grpc.aio`` on asyncio's loop, on uvloop, and by the sync
``grpc.server`` with a thread pool, each in its own process, called by the sync Python client (as
``bench.grpc_latency``'s rows are), one call in flight: p50 and p99 in ms. With ``--native DIR``
(``make -C bench/native`` builds it with grpc++, e.g. Debian's libgrpc++-dev) a C++ server joins
the servers and a C++ client calls every server too: the rows then say what grpcio's server costs
beside a native one, and what the Python client itself costs.

Sizes (request -> answer bytes): 64 -> 64; 12,800 -> 8,192 (a session step: one token's q, k, v
of Hq 32 / Hkv 8 / D 128 bf16, its o back); 393,216 -> 131,072 (the small attention call,
1x8x128x64 fp16 q, k, v); 786,432 -> 524,288 (a packed step of 64 such sessions). A transport's
added latency cannot go below its row on the same host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc

KINDS = ("asyncio", "uvloop", "sync")
SIZES = ((64, 64), (12_800, 8_192), (393_216, 131_072), (786_432, 524_288))  # (request, answer) data bytes
METHOD = "/grpcfloor.Echo/Echo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blob(data: bytes | memoryview) -> bytes:
    """``data`` as a serialized ``grpcfloor.Blob`` (field 1, bytes): tag, varint length, the bytes
    (copied once, as a native server copies them into its answer)."""
    n, head = len(data), bytearray(b"\x0a")
    while True:
        head.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return b"".join((head, data))


def blob_data(message: bytes) -> memoryview:
    """The bytes of a serialized ``grpcfloor.Blob`` (field 1 alone, as ``blob`` writes it)."""
    if not message:
        return memoryview(b"")
    n, shift, i = 0, 0, 1
    while True:
        b = message[i]
        n |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if not b & 0x80:
            return memoryview(message)[i : i + n]


def request(size: int, answer: int) -> bytes:
    """A Blob of ``size`` random bytes whose first 4 (little-endian) ask for ``answer`` bytes back."""
    return blob(struct.pack("<I", answer) + os.urandom(size - 4))


def _answer(message: bytes) -> bytes:
    data = blob_data(message)
    (n,) = struct.unpack_from("<I", data)
    return blob(data[:n])


def serve(kind: str, port: int) -> None:
    """Serve the echo method on 127.0.0.1:port until killed."""
    def ident(b):
        return b

    unlimited = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    if kind == "sync":
        from concurrent.futures import ThreadPoolExecutor

        server = grpc.server(ThreadPoolExecutor(8), options=unlimited)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "grpcfloor.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: _answer(r), ident, ident)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def echo(request, context):
        return _answer(request)

    async def main():
        server = grpc.aio.server(options=unlimited)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "grpcfloor.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo, ident, ident)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if kind == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def measure(port: int, size: int, answer: int, iters: int, warmup: int = 200) -> tuple[float, float]:
    """(p50, p99) ms of one echo call from the sync Python client, one in flight."""
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        message = request(size, answer)
        if blob_data(call(message)) != blob_data(message)[:answer]:
            raise RuntimeError(f"the echo server answered {size} B wrongly")
        for _ in range(warmup):
            call(message)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            call(message)
            times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2], 1e3 * times[int(len(times) * 0.99)]


def measure_native(client: Path, port: int, size: int, answer: int, iters: int) -> tuple[float, float]:
    """(p50, p99) ms from the C++ client (it checks each answer's bytes and prints ``p50 p99``)."""
    out = subprocess.run([str(client), str(port), str(size), str(answer), str(iters)], capture_output=True,
                         text=True, timeout=600, check=True).stdout.split()
    return float(out[0]), float(out[1])


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"no echo server on port {port} after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--kinds", default=",".join(KINDS), help="Python server kinds (comma-separated)")
    ap.add_argument("--native", type=Path, default=None,
                    help="a folder with echo_server and echo_client (make -C bench/native): C++ rows too")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve[0], int(a.serve[1]))
        return
    servers = [(kind, [sys.executable, "-m", "bench.grpc_floor", "--serve", kind]) for kind in a.kinds.split(",")]
    clients = ["python"]
    if a.native is not None:
        for name in ("echo_server", "echo_client"):
            if not (a.native / name).is_file():
                ap.error(f"--native {a.native}: no {name} there; build it with `make -C bench/native`")
        servers.append(("c++", [str(a.native / "echo_server")]))
        clients.append("c++")
    print("| server | client | request bytes | answer bytes | p50 ms | p99 ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind, cmd in servers:
        port = _free_port()
        proc = subprocess.Popen([*cmd, str(port)])
        try:
            _wait_listening(port)
            for client in clients:
                for size, answer in SIZES:
                    if client == "python":
                        p50, p99 = measure(port, size, answer, a.iters)
                    else:
                        p50, p99 = measure_native(a.native / "echo_client", port, size, answer, a.iters)
                    print(f"| {kind} | {client} | {size} | {answer} | {p50:.3f} | {p99:.3f} |", flush=True)
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
