"""gRPC transport benchmark: what a small call pays above the kernel, and streaming beside unary.

    python -m bench.grpc_latency                          # starts `python -m service` itself (--device auto)
    python -m bench.grpc_latency --target HOST:8001       # against a running server (same machine for (1))
    python -m bench.grpc_latency --iters 2000 --concurrency 16 --stream-calls 20000
    python -m bench.grpc_latency --device cpu --shape 1x1x16x16 --dtype float32 --rows attend,pingpong
    python -m bench.grpc_latency --server sync ...        # the sync-server experiment (bench/grpc_sync_server.py)
    bash bench/gpu.sh service                             # with the engine and HTTP benchmarks, into reports/service/

Rows (1x8x128x64 fp16 q/k/v by default, 384 KiB per request):
  kernel          kernels.attention on --device in this process, inputs already there (CUDA events
                  / synchronize): the floor.
  Attend          unary attention.v1 Attend, one call in flight, request message built once:
                  p50/p90/p99 and the p50 *added* above the kernel (transport + decode + queue + copy).
  Attend+client   the same through GrpcAttentionClient (tensor <-> message conversion included).
  ModelInfer      Open Inference Protocol ModelInfer (our inference stubs), one in flight.
  Attend xC       unary, C threads on one channel: throughput.
  AttendStream 1  one open AttendStream, one call in flight (send, wait for its answer, send the
                  next): p50 and the p50 added above the kernel.
  AttendStream    one bidirectional stream carrying --stream-calls calls: throughput (the server
                  runs up to 64 of a stream's calls at once).
  AttendStream xS S streams at once: throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

import kernels
from bench.local import local_server as bench_server
from service.client import GrpcAttentionClient
from service.grpc.codec import tensor_to_pb
from service.grpc.protogen import attention_stubs, inference_stubs
from service.wire import tensors as codec
from service.wire.tensors import ServerTiming

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("attend", "client", "oip", "threads", "pingpong", "stream", "streams")
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


@contextlib.contextmanager
def local_server(device: str, shape: str, dtype: str):
    """``python -m service`` on free ports, warmed for ``shape``; yields its gRPC target once ready."""
    with bench_server("--device", device, "--warmup-shapes", shape, "--warmup-dtypes", dtype,
                      "--log-level", "warning") as s:
        yield s.grpc_target


@contextlib.contextmanager
def sync_server(device: str, shape: str, dtype: str):
    """bench/grpc_sync_server.py on a free port (the sync-server experiment); yields its target."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_sync_server", "--host", "127.0.0.1",
                             "--grpc-port", str(port), "--device", device, "--warmup-shapes", shape,
                             "--warmup-dtypes", dtype, "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the sync server did not start ({proc.wait()})")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def stream_pingpong(stub, msg, iters: int, warmup: int) -> list[float]:
    """Seconds per call on one open AttendStream with one call in flight."""
    sends: queue.Queue = queue.Queue()

    def requests():
        while (item := sends.get()) is not None:
            yield item

    answers = stub.AttendStream(requests(), timeout=600)
    out = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        sends.put(msg)
        next(answers)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    sends.put(None)
    for _ in answers:
        pass
    return out


def kernel_p50(q, k, v, device: str, iters: int) -> float:
    """p50 seconds of kernels.attention on device-resident inputs."""
    dq, dk, dv = (t.to(device) for t in (q, k, v))
    cuda = dq.is_cuda
    for _ in range(20):
        kernels.attention(dq, dk, dv)
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernels.attention(dq, dk, dv)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            kernels.attention(dq, dk, dv)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed(call, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def threaded_throughput(call, threads: int, calls_each: int) -> float:
    """calls/s with ``threads`` threads each making ``calls_each`` calls."""
    barrier = threading.Barrier(threads + 1)

    def work():
        barrier.wait()
        for _ in range(calls_each):
            call()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return threads * calls_each / (time.perf_counter() - t0)


def stream_throughput(stub, msg, streams: int, calls: int) -> float:
    """calls/s of ``streams`` AttendStreams carrying ``calls`` calls in all."""
    per = max(1, calls // streams)

    def one():
        n = sum(1 for _ in stub.AttendStream((msg for _ in range(per)), timeout=600))
        assert n == per

    return threaded_throughput(one, streams, 1) * per


def oip_request(q, k, v):
    pb = inference_stubs().grpc_predict_v2_pb2
    req = pb.ModelInferRequest(model_name="attention")
    for name, t in (("q", q), ("k", k), ("v", v)):
        req.inputs.add(name=name, datatype=codec.OIP_NAMES[t.dtype], shape=list(t.shape))
        req.raw_input_contents.append(codec.tensor_to_bytes(t))
    return req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HOST:PORT of a running server (default: start one here)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of the kernel row (and of the server started here: 'auto' uses every GPU)")
    ap.add_argument("--shape", default="1x8x128x64", help="BxHxNxD of q, k, v")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8, help="threads of the 'Attend xC' row")
    ap.add_argument("--streams", type=int, default=4, help="streams of the 'AttendStream xS' row")
    ap.add_argument("--stream-calls", type=int, default=5000)
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"which rows, comma-separated, of {','.join(ROWS)} (the kernel row always)")
    ap.add_argument("--server", default="aio", choices=["aio", "sync"],
                    help="the server started here: the service (aio), or the sync-server experiment "
                         "(bench/grpc_sync_server.py: Attend and AttendStream only)")
    args = ap.parse_args()

    shape = [int(x) for x in args.shape.split("x")]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(codec.DTYPES[args.dtype]) for _ in range(3))
    stubs = attention_stubs()
    msg = stubs.attention_pb2.AttendRequest(q=tensor_to_pb(q), k=tensor_to_pb(k), v=tensor_to_pb(v))

    wanted = set(args.rows.split(","))
    if unknown := wanted - set(ROWS):
        ap.error(f"--rows: unknown {', '.join(sorted(unknown))}")
    server_device = "auto" if args.device.startswith("cuda") else args.device
    if args.target:
        server = contextlib.nullcontext(args.target)
    elif args.server == "sync":
        server = sync_server(server_device if server_device != "auto" else "cuda", args.shape, args.dtype)
    else:
        server = local_server(server_device, args.shape, args.dtype)
    with server as target, grpc.insecure_channel(target, options=OPTIONS) as ch, \
            GrpcAttentionClient(target, timeout=600) as client:
        stub = stubs.attention_pb2_grpc.AttentionServiceStub(ch)
        oip = inference_stubs().grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(ch)
        oip_req = oip_request(q, k, v)

        kernel = kernel_p50(q, k, v, args.device, args.iters)
        rows = [("kernel", [kernel], None)]
        phases: dict[str, list[float]] = {}

        def attend():  # with the server's own split of the call (trailing metadata "server-timing")
            _, call = stub.Attend.with_call(msg, timeout=60)
            for key, value in call.trailing_metadata() or ():
                if key == "server-timing":
                    for phase, ms in ServerTiming.parse(value).items():
                        phases.setdefault(phase, []).append(ms)

        for key, name, call in (("attend", "Attend", attend),
                                ("client", "Attend+client", lambda: client.attention(q, k, v)),
                                ("oip", "ModelInfer", lambda: oip.ModelInfer(oip_req, timeout=60))):
            if key in wanted:
                rows.append((name, timed(call, args.iters, args.warmup), None))
        if "threads" in wanted:
            per_thread = max(1, args.iters // args.concurrency)
            rows.append((f"Attend x{args.concurrency}", None,
                         threaded_throughput(lambda: stub.Attend(msg, timeout=60), args.concurrency, per_thread)))
        if "pingpong" in wanted:
            rows.append(("AttendStream 1", stream_pingpong(stub, msg, args.iters, args.warmup), None))
        if "stream" in wanted or "streams" in wanted:
            stream_throughput(stub, msg, 1, args.warmup)
        if "stream" in wanted:
            rows.append(("AttendStream", None, stream_throughput(stub, msg, 1, args.stream_calls)))
        if "streams" in wanted:
            rows.append((f"AttendStream x{args.streams}", None,
                         stream_throughput(stub, msg, args.streams, args.stream_calls)))

    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\ngRPC latency: {args.shape} {args.dtype}, kernel on {args.device} ({dev}), "
          f"{os.cpu_count()} CPUs, grpcio {grpc.__version__}, {args.target or args.server} server\n")
    print("| path | p50 (µs) | p90 (µs) | p99 (µs) | added p50 over kernel (µs) | calls/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, lat, rate in rows:
        if lat is not None:
            p50 = statistics.median(lat)
            added = "" if name == "kernel" else f"{(p50 - kernel) * 1e6:.0f}"
            p90, p99 = pct(lat, 90) * 1e6, pct(lat, 99) * 1e6
            print(f"| {name} | {p50 * 1e6:.0f} | {p90:.0f} | {p99:.0f} | {added} | {1 / p50:.0f} |")
        else:
            print(f"| {name} | | | | | {rate:.0f} |")
    if phases:
        split = {k: statistics.median(v) for k, v in phases.items()}
        attend_p50 = statistics.median(next(lat for name, lat, _ in rows if name == "Attend")) * 1e3
        print("\nAttend, server p50 ms: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items())
              + f"; outside the handler (grpc, sockets, client) ~{attend_p50 - sum(split.values()):.3f}")


if __name__ == "__main__":
    main()
