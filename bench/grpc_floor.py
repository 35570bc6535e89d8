"""gRPC's own floor on a host: what grpcio costs a call with no engine behind it.

    python -m bench.grpc_floor                 # every server kind, 64 B and the small call's sizes
    python -m bench.grpc_floor --iters 5000

An echo method (bytes in, a third of them back) served by ``grpc.aio`` on asyncio's loop, on
uvloop, and by the sync ``grpc.server`` with a thread pool, each in its own process, called by the
sync Python client (as ``bench.grpc_latency``'s rows are), one call in flight: p50 and p99 in ms.
Request sizes: 64 B, and 384 KiB (the small attention call, 1x8x128x64 fp16 q, k, v, whose answer
is 128 KiB). A transport's added latency cannot go below this row on the same host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc

KINDS = ("asyncio", "uvloop", "sync")
SIZES = (64, 393216)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answer(request: bytes) -> bytes:
    return request[: len(request) // 3] if len(request) > 1024 else request


def serve(kind: str, port: int) -> None:
    """Serve the echo method on 127.0.0.1:port until killed."""
    def ident(b):
        return b

    if kind == "sync":
        from concurrent.futures import ThreadPoolExecutor

        server = grpc.server(ThreadPoolExecutor(8))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "floor.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: _answer(r), ident, ident)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def echo(request, context):
        return _answer(request)

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "floor.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo, ident, ident)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if kind == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def measure(port: int, size: int, iters: int, warmup: int = 200) -> tuple[float, float]:
    """(p50, p99) ms of one echo call of ``size`` bytes, one in flight."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_unary("/floor.Echo/Echo", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        request = os.urandom(size)
        if call(request) != _answer(request):
            raise RuntimeError(f"the echo server answered {size} B wrongly")
        for _ in range(warmup):
            call(request)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            call(request)
            times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2], 1e3 * times[int(len(times) * 0.99)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve[0], int(a.serve[1]))
        return
    print("| server | request bytes | p50 ms | p99 ms |\n| --- | ---: | ---: | ---: |")
    for kind in a.kinds.split(","):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve", kind, str(port)])
        try:
            for size in SIZES:
                p50, p99 = measure(port, size, a.iters)
                print(f"| {kind} | {size} | {p50:.3f} | {p99:.3f} |", flush=True)
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
