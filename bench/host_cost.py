"""The service's own host cost: a server whose kernels only allocate their outputs, under a closed
loop of small calls; the server process's CPU time per call and the calls per second.

    python -m bench.host_cost                          # starts both servers itself, on the CPU
    python -m bench.host_cost --transports http,grpc,step,packed --threads 8 --seconds 5 --rounds 6
    python -m bench.host_cost --baseline /tmp/old      # also a server from another checkout, rounds alternating
    python -m bench.host_cost --serve -- --device cpu --http-port 18100   # only the server (kernels empty)

What is left with empty kernels is what the service does per call on the host (the transport,
decoding, batching, staging, copies, answering): the quantity issue 32's per-process targets are
about, measurable on a machine without a GPU. Rows:
  http  POST /attention, 1x8x128x64 fp16 safetensors, over keep-alive connections;
  grpc  Attend with the same tensors, one channel a thread;
  step  SessionAttend: one token of one session (Hq 32, Hkv 8, D 128, bf16) a call, a session a thread;
  packed  POST /sessions/attend: one token of each of 64 sessions (as step) a call, over keep-alive
        connections; a thread's sessions end every 256 calls (``end`` on the last step) and start
        again, so the 64 creations a thread makes per 256 calls count in its CPU time.
``--baseline DIR`` starts a second server from the checkout DIR (e.g. ``git worktree add DIR REV``)
and alternates rounds between the two, so both see the same machine load. CPU time is the server
process's user + system time (``/proc/PID/stat``) over the round, divided by the calls answered.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ("http", "grpc", "step", "packed")
PACKED_SESSIONS = 64  # a packed row's sessions a thread, one token each a call
PACKED_CALLS = 256  # calls before a thread's sessions end (their last step's ``end``) and start again
SMALL = (1, 8, 128, 64)


def serve(argv: list[str]) -> None:
    """Run the service in this process with its kernels replaced by output allocations."""
    import kernels

    def attention(q, k, v, *args, return_lse=False, **kwargs):
        o = torch.empty_like(q)
        return (o, torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)) if return_lse else o

    def attention_paged(q, k_pages, v_pages, table, lengths, cu_q, *args, return_lse=False, **kwargs):
        o = torch.empty_like(q)
        return (o, torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)) if return_lse else o

    kernels.attention, kernels.attention_paged = attention, attention_paged  # the workers call them through the module
    kernels.append_paged = lambda *args, **kwargs: None
    from service.server import main
    from service.settings import load_settings

    main(load_settings(argv), argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """This file's ``--serve`` over the service of the checkout ``root``, on free ports."""

    def __init__(self, root: Path):
        self.http, self.grpc = _free_port(), _free_port()
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--", "--device", "cpu", "--http-port", str(self.http),
             "--grpc-port", str(self.grpc), "--warmup-shapes", "1x1x16x16", "--warmup-dtypes", "float32",
             "--kv-cache-mb", "1024"],
            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{self.http}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"the server from {root} did not become ready")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _caller(transport: str, server: Server, seed: int):
    """A function making one call (raising on a wrong status), for one client thread."""
    g = torch.Generator().manual_seed(seed)
    if transport == "http":
        import http.client

        import safetensors.torch as st

        body = st.save({n: torch.randn(*SMALL, generator=g).half() for n in "qkv"})
        conn = http.client.HTTPConnection("127.0.0.1", server.http)
        headers = {"Content-Type": "application/x-safetensors"}

        def call():
            conn.request("POST", "/attention", body, headers)
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")

        return call
    if transport == "packed":
        return _packed_caller(server, g)
    from service.client.grpc import GrpcAttentionClient

    client = GrpcAttentionClient(f"127.0.0.1:{server.grpc}")
    if transport == "grpc":
        q, k, v = (torch.randn(*SMALL, generator=g).half() for _ in range(3))
        return lambda: client.attention(q, k, v)
    session = client.create_session(8, 128, torch.bfloat16)
    q, k, v = (torch.randn(1, h, 1, 128, generator=g).bfloat16() for h in (32, 8, 8))
    return lambda: client.step(session, q, k, v)


def _packed_caller(server: Server, g: torch.Generator):
    """A thread's packed steps over its own sessions (see the module's docstring)."""
    import http.client
    import json

    import safetensors.torch as st

    conn = http.client.HTTPConnection("127.0.0.1", server.http)
    n = PACKED_SESSIONS
    tensors = {name: torch.randn(n, h, 128, generator=g).bfloat16() for name, h in (("q", 32), ("k", 8), ("v", 8))}
    tensors["q_lengths"] = torch.ones(n, dtype=torch.int32)
    state = {"calls": PACKED_CALLS, "body": b"", "last": b"", "ids": []}

    def post(path: str, body: bytes, content_type: str) -> bytes:
        conn.request("POST", path, body, {"Content-Type": content_type})
        r = conn.getresponse()
        data = r.read()
        if r.status not in (200, 201):
            raise RuntimeError(f"HTTP {r.status} from {path}: {data[:200]!r}")
        return data

    def call():
        if state["calls"] == PACKED_CALLS:
            create = json.dumps({"layers": 1, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}).encode()
            state["ids"] = [json.loads(post("/sessions", create, "application/json"))["session"] for _ in range(n)]
            meta = {"sessions": ",".join(state["ids"])}
            state["body"] = st.save(tensors, metadata=meta)
            state["last"] = st.save(tensors, metadata={**meta, "end": "true"})
            state["calls"] = 0
        state["calls"] += 1
        post("/sessions/attend", state["last"] if state["calls"] == PACKED_CALLS else state["body"],
             "application/x-safetensors")

    def close():  # the round is over: its sessions end (those ended already answer 404)
        if state["calls"] < PACKED_CALLS:
            for sid in state["ids"]:
                conn.request("DELETE", f"/sessions/{sid}")
                conn.getresponse().read()

    call.close = close
    return call


def round_(transport: str, server: Server, threads: int, seconds: float) -> tuple[float, float]:
    """(calls a second, server CPU ms a call) of one round of ``threads`` closed loops."""
    callers = [_caller(transport, server, i) for i in range(threads)]
    counts, stop, errors = [0] * threads, threading.Event(), []
    go = threading.Barrier(threads + 1)

    def loop(i: int) -> None:
        go.wait()
        try:
            while not stop.is_set():
                callers[i]()
                counts[i] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            stop.set()

    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    go.wait()
    time.sleep(min(1.0, seconds / 4))  # connections made, the loop warm
    n0, c0, t0 = sum(counts), server.cpu_s(), time.perf_counter()
    time.sleep(seconds)
    n1, c1, t1 = sum(counts), server.cpu_s(), time.perf_counter()
    stop.set()
    for w in workers:
        w.join(60)
    for c in callers:
        getattr(c, "close", lambda: None)()
    if errors:
        raise errors[0]
    return (n1 - n0) / (t1 - t0), 1e3 * (c1 - c0) / max(1, n1 - n0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", help="only run a server with empty kernels (its options after --)")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help=f"of {','.join(TRANSPORTS)}")
    ap.add_argument("--threads", type=int, default=8, help="client threads (closed loops) a round")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds a round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds a server and transport (medians reported)")
    ap.add_argument("--baseline", type=Path, help="a checkout to compare with (rounds alternate)")
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.rest)
        return
    os.environ.pop("TRITON_INTERPRET", None)
    transports = [t for t in args.transports.split(",") if t]
    bad = set(transports) - set(TRANSPORTS)
    if bad:
        ap.error(f"unknown transports {sorted(bad)}; use {','.join(TRANSPORTS)}")
    servers = {"this checkout": Server(ROOT)}
    try:
        if args.baseline is not None:
            servers = {f"baseline ({args.baseline})": Server(args.baseline.resolve()), **servers}
        print(f"{args.threads} client threads, {args.seconds:g} s rounds, {args.rounds} rounds a row, "
              f"{os.cpu_count()} CPUs; medians (min-max)\n")
        print("| transport | server | calls/s | server CPU ms a call |\n|---|---|---|---|")
        for transport in transports:
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, server in servers.items():
                    got[name].append(round_(transport, server, args.threads, args.seconds))
            for name, rows in got.items():
                rates, cpus = [r for r, _ in rows], [c for _, c in rows]
                print(f"| {transport} | {name} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
                      f"| {statistics.median(cpus):.3f} ({min(cpus):.3f}-{max(cpus):.3f}) |", flush=True)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:  # run as a file (a server): bench/ would
        sys.path.pop(0)  # shadow the packages (bench/kernels.py), which come from PYTHONPATH's checkout
    main()
