"""Sessions across processes (docs/api.md#sessions, service/sessions/routing.py): under --processes 2 a session
call reaches the process that holds the session whichever process accepted the connection, over
HTTP and gRPC; GET /sessions is the union; a packed step across processes is a 422 naming the groups."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import httpx
import pytest
import safetensors.torch as st
import torch
from conftest import run_server

from service.client import GrpcAttentionClient
from service.errors import ServiceError
from service.sessions import routing
from service.wire import SESSION_HEADER

HKV, HQ, D = 2, 4, 16
ST = {"Content-Type": "application/x-safetensors"}
FWD = routing.FORWARDED


def test_owner_is_a_pure_function_and_server_ids_land_home():
    assert routing.owner("abc", 2) == __import__("zlib").crc32(b"abc") % 2
    assert routing.owner("abc", 1) == 0
    # a group (the part before the first ":") lives in one process, whatever follows it
    zlib = __import__("zlib")
    for n in (2, 3, 5):
        assert {routing.owner(f"g7:{i}", n) for i in range(40)} == {zlib.crc32(b"g7") % n}
        assert routing.owner(":x", n) == zlib.crc32(b":x") % n  # no group before it: the whole id
    p = routing.Peers.parse("1/3@/tmp/x")
    assert (p.index, p.count, p.folder, p.http_path(2)) == (1, 3, "/tmp/x", "/tmp/x/http-2.sock")
    for bad in ("3/3@/tmp/x", "1/3", "a/b@/x", "1@/x"):
        with pytest.raises(ValueError):
            routing.Peers.parse(bad)

    class S:
        peers = "1/3@/tmp/x"

    draw = routing.new_session_id(S())
    assert all(routing.owner(draw(), 3) == 1 for _ in range(50))
    with pytest.raises(ServiceError, match="process 0: .*process 1: "):
        routing.single_owner(routing.Peers(0, 2, "/x"), [s for s in map(str, range(10))])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("routing"), "--processes", "2", "--warmup-shapes", "1x1x16x16",
                    "--warmup-dtypes", "float32") as s:
        yield s


def call(method: str, url: str, **kw) -> httpx.Response:
    """One call on a new connection (either process may accept it); a process still warming: retry."""
    for _ in range(200):
        r = httpx.request(method, url, timeout=60, **kw)
        if r.status_code != 503:
            return r
        time.sleep(0.1)
    return r


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def attention(url, q, k, v):
    r = call("POST", url + "/attention", params={"causal": "true"}, headers=ST,
             content=st.save({"q": q, "k": k, "v": v}))
    assert r.status_code == 200, r.text
    return st.load(r.content)["o"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="--processes")
def test_http_steps_reach_their_process(server):
    url = server.url
    ids = []
    for i in range(10):  # half client-chosen, half server-made
        body = {"num_kv_heads": HKV, "head_dim": D, "dtype": "float32"}
        if i % 2:
            body["session"] = f"client-{i}"
        r = call("POST", url + "/sessions", json=body)
        assert r.status_code == 201, r.text
        ids.append(r.json()["session"])
    ks = {s: [] for s in ids}
    vs = {s: [] for s in ids}
    fronts = set()
    forwarded = 0
    for rnd, n in enumerate((5, 1, 2)):
        for j, s in enumerate(ids):
            seed = 1000 * rnd + 10 * j
            q, k, v = rand(1, HQ, n, D, seed=seed), rand(1, HKV, n, D, seed=seed + 1), rand(1, HKV, n, D, seed=seed + 2)
            r = call("POST", f"{url}/sessions/{s}/attend", headers={**ST, SESSION_HEADER: s},
                     content=st.save({"q": q, "k": k, "v": v}))
            assert r.status_code == 200, r.text
            ks[s].append(k)
            vs[s].append(v)
            want = attention(url, q, torch.cat(ks[s], 2), torch.cat(vs[s], 2))
            torch.testing.assert_close(st.load(r.content)["o"], want, atol=1e-5, rtol=1e-5)
            if FWD in r.headers:
                front, owner = map(int, r.headers[FWD].split("->"))
                assert owner == routing.owner(s, 2) != front
                forwarded += 1
                fronts.add(front)
    assert forwarded and len(fronts) == 2, (forwarded, fronts)  # both processes forwarded some
    listing = call("GET", url + "/sessions").json()
    assert listing["processes"] == 2 and sorted(listing["sessions"]) == sorted(ids) and listing["count"] == 10
    for s in ids:
        assert call("GET", f"{url}/sessions/{s}").json()["lengths"] == [8]

    # a packed step: one process's sessions together are served; across processes a 422 naming the groups
    home = [s for s in ids if routing.owner(s, 2) == 0][:2]
    q, k, v = rand(2, HQ, D, seed=7), rand(2, HKV, D, seed=8), rand(2, HKV, D, seed=9)
    for _ in range(3):
        r = call("POST", url + "/sessions/attend", params={"sessions": ",".join(home)}, headers=ST,
                 content=st.save({"q": q, "k": k, "v": v, "q_lengths": torch.tensor([1, 1], dtype=torch.int32)}))
        assert r.status_code == 200, r.text
    r = call("POST", url + "/sessions/attend", headers=ST, content=st.save(
        {"q": q, "k": k, "v": v, "q_lengths": torch.tensor([1, 1], dtype=torch.int32)},
        metadata={"sessions": ",".join(ids[:2] if routing.owner(ids[0], 2) != routing.owner(ids[1], 2)
                                       else [home[0], next(s for s in ids if routing.owner(s, 2) == 1)])}))
    assert r.status_code == 422 and "process 0: " in r.text and "process 1: " in r.text, r.text
    # DELETE from any connection; then every process says 404
    for s in ids:
        assert call("DELETE", f"{url}/sessions/{s}").status_code == 204
    for s in ids:
        assert call("GET", f"{url}/sessions/{s}").status_code == 404
    assert call("GET", url + "/sessions").json()["count"] == 0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="--processes")
def test_grpc_steps_reach_their_process(server):
    url = server.url
    call("GET", url + "/sessions")  # both processes up
    with GrpcAttentionClient(server.grpc_target) as first:
        made = [first.create_session(HKV, D, torch.float32, session=f"g-{i}") for i in range(4)]
        made += [first.create_session(HKV, D, torch.float32) for _ in range(4)]
    ids = [s.id for s in made]
    ks = {s: [] for s in ids}
    vs = {s: [] for s in ids}
    for rnd in range(2):
        for j, s in enumerate(ids):  # a fresh channel per step: the kernel deals them out
            seed = 500 + 100 * rnd + 10 * j
            q, k, v = rand(1, HQ, 3, D, seed=seed), rand(1, HKV, 3, D, seed=seed + 1), rand(1, HKV, 3, D, seed=seed + 2)
            with GrpcAttentionClient(server.grpc_target) as c:
                o = c.step(s, q, k, v)
            ks[s].append(k)
            vs[s].append(v)
            want = attention(url, q, torch.cat(ks[s], 2), torch.cat(vs[s], 2))
            torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
    with GrpcAttentionClient(server.grpc_target) as c:  # a stream naming sessions of both processes, in order
        steps = [{"sessions": s, "q": rand(1, HQ, 1, D, seed=j), "k": rand(1, HKV, 1, D, seed=j + 1),
                  "v": rand(1, HKV, 1, D, seed=j + 2)} for j, s in enumerate(ids * 2)]
        answers = list(c.session_stream(steps))
        assert len(answers) == len(steps)
    for s in ids:
        with GrpcAttentionClient(server.grpc_target) as c:
            assert c.get_session(s)["lengths"] == [8]
    for s in ids:
        with GrpcAttentionClient(server.grpc_target) as c:
            c.delete_session(s)
    for s in ids:
        with GrpcAttentionClient(server.grpc_target) as c, pytest.raises(Exception) as err:
            c.get_session(s)
        code = getattr(err.value, "code", None)
        assert "not_found" in str(err.value).lower() or (callable(code) and code() == grpc.StatusCode.NOT_FOUND), \
            err.value


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="--processes")
@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_oip_sequence_calls_reach_their_process(server, kind):
    """tritonclient's infer(..., sequence_id=, sequence_start=, sequence_end=), a fresh connection
    per call (either process may take it): each sequence lives on its owner (GET /sessions/{id},
    itself routed, finds it there) and every step equals /attention over its keys; binary and
    JSON-only HTTP bodies, unary gRPC and ModelStreamInfer."""
    import numpy as np
    import tritonclient.grpc as tg
    import tritonclient.http as th

    mod = th if kind == "http" else tg
    url = server.url
    call("GET", url + "/sessions")  # both processes up

    def client():
        return (th.InferenceServerClient(f"127.0.0.1:{server.http_port}") if kind == "http"
                else tg.InferenceServerClient(server.grpc_target))

    def inputs(tensors, binary=True):
        out = []
        for name, t in tensors.items():
            inp = mod.InferInput(name, list(t.shape), "FP32")
            if kind == "http":
                inp.set_data_from_numpy(t.numpy(), binary_data=binary)
            else:
                inp.set_data_from_numpy(t.numpy())
            out.append(inp)
        return out

    ids = [f"oip-{kind}-{i}" for i in range(4)] + [7000 + 10 * i + (kind == "grpc") for i in range(4)]
    ks = {s: [] for s in ids}
    vs = {s: [] for s in ids}
    for rnd, n in enumerate((4, 1, 1)):
        for j, s in enumerate(ids):
            seed = 3000 + 100 * rnd + 10 * j
            q, k, v = rand(1, HQ, n, D, seed=seed), rand(1, HKV, n, D, seed=seed + 1), rand(1, HKV, n, D, seed=seed + 2)
            ks[s].append(k)
            vs[s].append(v)
            res = client().infer("attention", inputs({"q": q, "k": k, "v": v}, binary=j % 2 == 0),
                                 outputs=[mod.InferRequestedOutput("o")], sequence_id=s, sequence_start=rnd == 0)
            want = attention(url, q, torch.cat(ks[s], 2), torch.cat(vs[s], 2))
            torch.testing.assert_close(torch.from_numpy(np.array(res.as_numpy("o"))), want, atol=1e-5, rtol=1e-5)
    for s in ids:
        assert call("GET", f"{url}/sessions/{s}").json()["lengths"] == [6], s
    if kind == "grpc":  # one stream naming sequences of both processes: answered, then ended
        answers = []
        c = client()
        c.start_stream(callback=lambda result, error: answers.append((result, error)))
        for j, s in enumerate(ids):
            q = rand(1, HQ, 1, D, seed=9000 + j)
            c.async_stream_infer("attention", inputs({"q": q}), sequence_id=s, sequence_end=True,
                                 outputs=[mod.InferRequestedOutput("o")])
        c.stop_stream()
        assert len(answers) == len(ids) and all(e is None for _, e in answers), answers
    else:
        for s in ids:
            q = rand(1, HQ, 1, D, seed=9000)
            client().infer("attention", inputs({"q": q}), sequence_id=s, sequence_end=True)
    assert not set(call("GET", url + "/sessions").json()["sessions"]) & set(map(str, ids))  # ended, each


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="--processes")
def test_sessions_of_one_group_pack_together_from_any_process(server):
    """Sessions named <group>:<i> live in one process: a packed step over them is served whichever
    process accepts it (fresh connections), and equals each session's single steps; SessionCache
    names a batch's sessions so."""
    from service.client import AttentionClient
    from service.client.transformers import SessionCache

    url = server.url
    ids = [f"batch-{i % 3}x:{i}" for i in range(6)]  # three groups of two
    for s in ids:
        r = call("POST", url + "/sessions", json={"session": s, "num_kv_heads": HKV, "head_dim": D,
                                                   "dtype": "float32"})
        assert r.status_code == 201, r.text
    groups = [[s for s in ids if s.startswith(f"batch-{g}x:")] for g in range(3)]
    ks = {s: [] for s in ids}
    vs = {s: [] for s in ids}
    for rnd in range(4):
        for g, members in enumerate(groups):
            q, k, v = (rand(len(members), h, D, seed=100 * rnd + 10 * g + j) for j, h in enumerate((HQ, HKV, HKV)))
            r = call("POST", url + "/sessions/attend", params={"sessions": ",".join(members)}, headers=ST,
                     content=st.save({"q": q, "k": k, "v": v,
                                      "q_lengths": torch.ones(len(members), dtype=torch.int32)}))
            assert r.status_code == 200, r.text
            o = st.load(r.content)["o"]
            for j, s in enumerate(members):
                ks[s].append(k[j][None, :, None])
                vs[s].append(v[j][None, :, None])
                want = attention(url, q[j][None, :, None], torch.cat(ks[s], 2), torch.cat(vs[s], 2))
                torch.testing.assert_close(o[j][None, :, None], want, atol=1e-5, rtol=1e-5)
    for s in ids:
        assert call("DELETE", f"{url}/sessions/{s}").status_code == 204

    class Config:  # what SessionCache reads of a model's config
        num_hidden_layers, num_key_value_heads, num_attention_heads, hidden_size, head_dim = 2, HKV, HQ, HQ * D, D

    with AttentionClient(url) as client:
        cache = SessionCache(client, Config(), batch_size=4, dtype=torch.float32)
        try:
            names = [s.id for s in cache.sessions]
            assert len({routing.owner(n, 2) for n in names}) == 1 and len(set(names)) == 4, names
        finally:
            cache.close()


def test_a_client_that_hangs_up_on_a_forwarded_call_harms_nothing(server):
    """A client that hangs up mid-body on a call one process forwards to the other: nobody reads an
    answer, so none is written and nothing is logged as an error (it once logged an ASGI traceback
    for each); nothing is appended, and both processes keep serving. (A hang-up after the body, while
    the owner holds the step, closes the forwarded connection too, so a queued step is withdrawn.)"""
    import socket
    from urllib.parse import urlsplit

    sids = [f"hang{i}" for i in range(8)]  # owned by both processes: each accepting process forwards some
    for sid in sids:
        assert call("POST", f"{server.url}/sessions", json={"session": sid, "num_kv_heads": 2, "head_dim": 16,
                                                            "dtype": "float32"}).status_code == 201
    q, k, v = rand(1, 4, 3, 16, seed=1), rand(1, 2, 3, 16, seed=2), rand(1, 2, 3, 16, seed=3)
    body = st.save({"q": q, "k": k, "v": v})
    url = urlsplit(server.url)
    for _ in range(2):
        for sid in sids:
            with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
                sock.sendall(b"POST /sessions/%s/attend HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/x-safetensors\r\nContent-Length: %d\r\n\r\n"
                             % (sid.encode(), len(body)) + body[: len(body) // 2])
                time.sleep(0.02)
    time.sleep(0.5)
    for sid in sids:
        assert call("GET", f"{server.url}/sessions/{sid}").json()["lengths"] == [0]
        r = call("POST", f"{server.url}/sessions/{sid}/attend", content=body,
                 headers={"Content-Type": "application/x-safetensors"})
        assert r.status_code == 200, r.text
        assert call("DELETE", f"{server.url}/sessions/{sid}").status_code == 204
    log = Path(server.log_path).read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def _children(pid: int) -> dict[int, int]:
    """{process index: pid} of the supervisor ``pid``'s serving processes (their ``--peers i/N@...``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if int(stat[1]) == pid and "--peers" in args:
            found[int(args[args.index("--peers") + 1].split("/")[0])] = int(entry.name)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="--processes")
def test_a_forwarded_call_to_a_stalled_process_ends_at_its_deadline(server):
    """The process holding a session stops answering (SIGSTOP) while another process forwards calls
    to it: the step gets 504 at its deadline (plus the hop's grace), not when the owner wakes, and
    the owner, once awake, does not run it (it keeps the deadline the call was forwarded with);
    GET /sessions answers 503 naming the silent process; gRPC without a client deadline ends at the
    server's. After the stall everything is served again."""
    import signal

    kids = _children(server.proc.pid)
    assert sorted(kids) == [0, 1], kids
    sid = next(f"stall{i}" for i in range(100) if routing.owner(f"stall{i}", 2) == 1)
    assert call("POST", f"{server.url}/sessions", json={"session": sid, "num_kv_heads": 2, "head_dim": 16,
                                                        "dtype": "float32"}).status_code == 201
    front = None
    for _ in range(200):  # a connection that process 0 accepted: it forwards the session's calls
        c = httpx.Client(base_url=server.url, timeout=30)
        if c.get(f"/sessions/{sid}").headers.get(routing.FORWARDED) == "0->1":
            front = c
            break
        c.close()
    assert front is not None, "no connection landed on process 0"
    q, k, v = rand(1, 4, 1, 16, seed=1), rand(1, 2, 1, 16, seed=2), rand(1, 2, 1, 16, seed=3)
    body = st.save({"q": q, "k": k, "v": v})
    deadline = {"X-Request-Timeout-Ms": "300"}
    os.kill(kids[1], signal.SIGSTOP)
    try:  # (one keep-alive connection: every call lands on process 0, never on the stopped one)
        t0 = time.monotonic()
        r = front.post(f"/sessions/{sid}/attend", content=body, headers={**ST, **deadline})
        took = time.monotonic() - t0
        listing = front.get("/sessions", headers=deadline)
    finally:
        os.kill(kids[1], signal.SIGCONT)
    assert r.status_code == 504 and "did not answer by the call's deadline" in r.text, r.text
    assert took < routing.HOP_GRACE_S + 2.0, took  # at the deadline and its grace, whatever the stall
    assert listing.status_code == 503 and "process 1 of 2 did not answer" in listing.text, listing.text
    time.sleep(0.5)  # the woken owner reads the forwarded step: past its deadline, never launched
    assert call("GET", f"{server.url}/sessions/{sid}").json()["lengths"] == [0]
    r = front.post(f"/sessions/{sid}/attend", content=body, headers=ST)
    assert r.status_code == 200, r.text
    assert call("GET", f"{server.url}/sessions/{sid}").json()["lengths"] == [1]
    front.close()
    assert call("DELETE", f"{server.url}/sessions/{sid}").status_code == 204
