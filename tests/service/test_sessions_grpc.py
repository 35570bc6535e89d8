"""Sessions over gRPC and through both Python clients, against a real CPU server (docs/api.md#sessions):
steps equal /attention over the whole K, V and a float64 reference; packed steps equal single ones
(bitwise); q-only steps; end; SessionAttendStream's in-band errors; every status code of the error
table of docs/api.md#sessions; the clients' session API and its context manager."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import run_server

from service.client import AttentionClient, AttentionServiceError, GrpcAttentionClient, Session
from tests.helpers import attention64

HKV, HQ, D = 2, 4, 16  # GQA 2:1; D = 16 the warmed head dim
SERVER_ARGS = ("--warmup-shapes", "1x1x16x16", "--warmup-dtypes", "float32", "--kv-page-tokens", "5",
               "--kv-cache-mb", "1")  # 1 MiB: 4096 tokens of (HKV, D) float32 keys and values


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("sessions-grpc"), *SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with GrpcAttentionClient(server.grpc_target, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with AttentionClient(server.url, timeout=60.0) as c:
        yield c


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def qkv(n, seed, hq=HQ, hkv=HKV, d=D):
    s = 3 * seed
    return rand(1, hq, n, d, seed=s), rand(1, hkv, n, d, seed=s + 1), rand(1, hkv, n, d, seed=s + 2)


def test_grpc_steps_equal_attention_over_the_whole_cache_and_float64(client, http):
    s = client.create_session(HKV, D, torch.float32, layers=2)
    assert isinstance(s, Session) and s.layers == 2 and s.dtype == "float32"
    ks, vs = {0: [], 1: []}, {0: [], 1: []}
    for i, (n, layer) in enumerate([(7, 0), (3, 1), (1, 0), (4, 0), (1, 1), (1, 0)]):
        q, k, v = qkv(n, i)
        o, lse = client.step(s, q, k, v, layer=layer, return_lse=True)
        ks[layer].append(k)
        vs[layer].append(v)
        kk, vv = torch.cat(ks[layer], 2), torch.cat(vs[layer], 2)
        want_o, want_lse = http.attention(q, kk, vv, causal=True, return_lse=True)
        torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
        o64, lse64 = attention64(q, kk, vv, causal=True)
        torch.testing.assert_close(o.double(), o64, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse.double(), lse64, rtol=1e-4, atol=1e-4)
        assert o.shape == (1, HQ, n, D) and lse.shape == (1, HQ, n)
    info = client.get_session(s)
    assert info["lengths"] == [13, 4] and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["kv_bytes"] == (3 + 1) * 2 * 5 * HKV * D * 4

    # q-only steps append nothing; causal=False sees every key; bnhd
    q = rand(1, HQ, 2, D, seed=99)
    kk, vv = torch.cat(ks[0], 2), torch.cat(vs[0], 2)
    torch.testing.assert_close(client.step(s, q), http.attention(q, kk, vv, causal=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(client.step(s, q, causal=False), http.attention(q, kk, vv), rtol=1e-5, atol=1e-5)
    o = client.step(s, q.transpose(1, 2).contiguous(), layout="bnhd")
    assert o.shape == (1, 2, HQ, D)
    torch.testing.assert_close(o.transpose(1, 2), http.attention(q, kk, vv, causal=True), rtol=1e-5, atol=1e-5)
    assert client.get_session(s)["lengths"] == [13, 4]

    # end: answered, then released
    client.step(s, q, end=True)
    with pytest.raises(AttentionServiceError) as e:
        client.get_session(s)
    assert e.value.status == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_packed_steps_equal_single_steps_bitwise(client, http, transport):
    c = client if transport == "grpc" else http
    sizes, new = [3, 1, 6], [2, 1, 3]
    pairs = []
    for _ in range(2):  # the same history twice: one stepped packed, its twin one by one
        group = [c.create_session(HKV, D, "float32") for _ in sizes]
        for i, (s, n) in enumerate(zip(group, sizes, strict=True)):
            c.step(s, *qkv(n, i))
        pairs.append(group)
    packed, single = pairs
    qs = [rand(n, HQ, D, seed=40 + i) for i, n in enumerate(new)]
    ks = [rand(n, HKV, D, seed=50 + i) for i, n in enumerate(new)]
    vs = [rand(n, HKV, D, seed=60 + i) for i, n in enumerate(new)]
    o, lse = c.packed_step(packed, torch.cat(qs), torch.cat(ks), torch.cat(vs), new, return_lse=True)
    assert o.shape == (sum(new), HQ, D) and lse.shape == (HQ, sum(new))
    at = 0
    for s, q, k, v, n in zip(single, qs, ks, vs, new, strict=True):
        o1, lse1 = c.step(s, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                          return_lse=True)
        assert torch.equal(o[at : at + n], o1[0].transpose(0, 1))
        assert torch.equal(lse[:, at : at + n], lse1[0])
        at += n
    # one session with 3-D tensors and q_lengths is a packed step too; q-only packed steps
    o = c.packed_step(packed[:1], qs[0], ks[0], vs[0], [new[0]])
    assert o.shape == (new[0], HQ, D)
    o = c.packed_step(packed, torch.cat(qs), None, None, new)
    assert o.shape == (sum(new), HQ, D)
    assert [c.get_session(s)["lengths"] for s in packed] == [[3 + 2 + 2], [1 + 1], [6 + 3]]
    for s in packed + single:
        c.delete_session(s)


def test_session_attend_says_where_the_server_time_went(client):
    """A unary SessionAttend carries the phases of Attend's trailing "server-timing" (decode, the
    engine's queue, stage, launch, device and return, encode), adding up to less than the call."""
    from service.grpc.codec import pb, tensor_to_pb
    from service.wire.tensors import ServerTiming

    s = client.create_session(HKV, D, "float32")
    q, k, v = qkv(2, 80)
    msg = pb.SessionAttendRequest(sessions=[s.id], q=tensor_to_pb(q), k=tensor_to_pb(k), v=tensor_to_pb(v))
    t0 = time.perf_counter()
    _, call = client._stub.SessionAttend.with_call(msg, timeout=60)
    wall_ms = 1e3 * (time.perf_counter() - t0)
    phases = ServerTiming.parse(dict(call.trailing_metadata())["server-timing"])
    assert list(phases) == ["decode", "queue", "stage", "launch", "device", "return", "encode"], phases
    assert all(ms >= 0 for ms in phases.values()) and sum(phases.values()) < wall_ms, (phases, wall_ms)
    client.delete_session(s)


def test_stream_answers_a_bad_step_in_band_and_goes_on(client, http):
    s = client.create_session(HKV, D, "float32", session="stream-1")
    q0, k0, v0 = qkv(4, 70)
    q1, k1, v1 = qkv(1, 71)
    bad = rand(1, HQ + 1, 1, D, seed=72)  # 5 query heads over 2 kv heads: not GQA
    q2, k2, v2 = qkv(2, 73)
    steps = [dict(sessions=[s.id], q=q0, k=k0, v=v0), dict(sessions=[s.id], q=q1, k=k1, v=v1),
             dict(sessions=[s.id], q=bad, k=k1, v=v1), dict(sessions=[s.id], q=q2, k=k2, v=v2, return_lse=True),
             dict(sessions=["no-such-session"], q=q2)]
    out = dict(client.session_stream(steps))
    assert sorted(out) == ["0", "1", "2", "3", "4"]
    assert isinstance(out["2"], AttentionServiceError) and out["2"].status == grpc.StatusCode.INVALID_ARGUMENT
    assert out["2"].code == "invalid_input"
    assert out["4"].status == grpc.StatusCode.NOT_FOUND
    kk, vv = torch.cat([k0, k1, k2], 2), torch.cat([v0, v1, v2], 2)  # in stream order; the bad step appended nothing
    o, lse = out["3"]
    torch.testing.assert_close(o, http.attention(q2, kk, vv, causal=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["1"], http.attention(q1, kk[:, :, :5], vv[:, :, :5], causal=True),
                               rtol=1e-5, atol=1e-5)
    assert client.get_session(s)["lengths"] == [7]
    client.delete_session(s)


def _status(fn, *args, **kwargs) -> AttentionServiceError:
    with pytest.raises(AttentionServiceError) as e:
        fn(*args, **kwargs)
    return e.value


def test_every_status_code_of_the_table(client):
    nf = grpc.StatusCode.NOT_FOUND
    assert _status(client.get_session, "nope").status == nf
    assert _status(client.delete_session, "nope").status == nf
    assert _status(client.step, "nope", *qkv(1, 1)).status == nf
    s = client.create_session(HKV, D, "float32", layers=2, session="codes")
    err = _status(client.create_session, HKV, D, "float32", session="codes")
    assert err.status == grpc.StatusCode.ALREADY_EXISTS and err.code == "already_exists"
    inv = grpc.StatusCode.INVALID_ARGUMENT
    assert _status(client.step, s, *qkv(1, 2, hkv=HKV * 2, hq=HQ * 2)).status == inv  # kv heads not the session's
    assert _status(client.step, s, *(t.half() for t in qkv(1, 2))).status == inv  # dtype
    assert _status(client.step, s, *qkv(1, 2, d=8)).status == inv  # head dim
    assert _status(client.step, s, *qkv(1, 2), layer=2).status == inv  # layer out of range
    q, k, v = (t[0].transpose(0, 1) for t in qkv(3, 3))
    assert _status(client.packed_step, [s], q, k, v, [2]).status == inv  # q_lengths not adding up
    assert _status(client.create_session, HKV, D, "int32").status == inv
    assert _status(client.create_session, HKV, 300, "float32").status == inv
    assert _status(client.create_session, HKV, D, "float32", session="attend").status == inv
    # no room: 1 MiB holds 4096 tokens of this geometry; the session keeps what it had
    client.step(s, *qkv(3, 4))
    err = _status(client.step, s, *qkv(5000, 5))
    assert err.status == grpc.StatusCode.RESOURCE_EXHAUSTED and err.code == "insufficient_storage"
    assert client.get_session(s)["lengths"] == [3, 0]
    client.delete_session(s)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_client_session_api_and_context_manager(client, http, transport):
    c = client if transport == "grpc" else http
    with c.session(num_kv_heads=HKV, head_dim=D, dtype=torch.float32, layers=2) as s:
        ks = []
        for i, n in enumerate([5, 1, 1]):
            q, k, v = qkv(n, 80 + i)
            ks.append((k, v))
            for layer in range(2):
                o = s.step(q, k, v, layer=layer)
            kk, vv = torch.cat([p[0] for p in ks], 2), torch.cat([p[1] for p in ks], 2)
            torch.testing.assert_close(o, http.attention(q, kk, vv, causal=True), rtol=1e-5, atol=1e-5)
        assert s.info()["lengths"] == [7, 7]
        assert str(s) in (http.get_session(s.id)["session"],)
    assert _status(c.get_session, s).code == "not_found"  # deleted on exit
    with c.session(HKV, D, "float32") as s:  # ended inside: the exit's 404 is ignored
        s.step(*qkv(2, 90), end=True)
    assert _status(c.get_session, s).code == "not_found"
    with pytest.raises(AttentionServiceError):
        s.delete(missing_ok=False)
    named = c.create_session(HKV, D, "float32", session=f"named-{transport}")
    assert named.id == f"named-{transport}" and c.get_session(named)["lengths"] == [0]
    c.delete_session(named.id)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_client_refusals_match_the_servers_and_name_the_item(server, client, http, transport):
    """What the gRPC messages cannot carry is refused by the client as the server refuses it over
    HTTP (an unknown dtype once made a float16 session, layers=0 one layer); ids a header cannot
    carry reach the server, which names them (400 / INVALID_ARGUMENT), where they once failed in
    the client's header encoding; q_lengths must be integers; a session_stream item that cannot be
    built (a misspelt option, a Session handle as its sessions is fine) is that item's outcome,
    and the stream goes on."""
    c = client if transport == "grpc" else http
    for dtype in ("fp32", "float64", torch.int8):
        err = _status(c.create_session, HKV, D, dtype)
        assert err.code in ("invalid_input", "unprocessable"), err
        assert "not supported" in err.message and "float16, bfloat16 or float32" in err.message
    assert "layers" in _status(c.create_session, HKV, D, "float32", layers=0).message
    for bad in ("é", "日本", "a\nb"):
        err = _status(c.create_session, HKV, D, "float32", session=bad)
        assert err.code == "bad_request" and "is not valid" in err.message, err
        assert _status(c.get_session, bad).code == "bad_request"
        assert _status(c.delete_session, bad).code == "bad_request"
        assert _status(c.step, bad, *qkv(1, 5)).code == "bad_request"
    with pytest.raises(ValueError, match="session_affinity must be printable ASCII"):
        type(c)(server.grpc_target if transport == "grpc" else server.url, session_affinity="é")
    s = c.create_session(HKV, D, "float32")
    q, k, v = (t[0].transpose(0, 1) for t in qkv(3, 6))
    with pytest.raises(TypeError, match="q_lengths must be integers"):
        c.packed_step([s], q, k, v, [2.9, 0.1])
    with pytest.raises(TypeError, match="q_lengths is empty"):  # (torch reads [] as float32)
        c.packed_step([s], q, k, v, [])
    o = c.packed_step(s, q, k, v, [3])  # one session alone, as a handle
    assert c.get_session(s)["lengths"] == [3]
    if transport == "grpc":
        q1, k1, v1 = (t[0].transpose(0, 1) for t in qkv(1, 7))
        items = [dict(sessions=s, q=q1, k=k1, v=v1, q_lengths=[1]),
                 dict(sessions=[s], q=q1, k=k1, v=v1, q_lengths=[1], casual=False),
                 dict(sessions=[s.id], q=q1, q_lengths=[1])]
        out = dict(client.session_stream(items))
        assert set(out) == {"0", "1", "2"}
        assert out["1"].status == grpc.StatusCode.INVALID_ARGUMENT and "item 1" in out["1"].message
        assert "casual" in out["1"].message
        assert torch.equal(out["2"], client.packed_step(s, q1, None, None, [1]))
        assert c.get_session(s)["lengths"] == [4]  # item 0 appended; items 1 and 2 did not
    c.delete_session(s)
    assert o.shape == q.shape


def test_leaving_a_session_block_keeps_the_bodys_error(http):
    """A session's ``with`` block that raises: that error reaches the caller even when the delete
    on the way out fails (the server gone: a handle on a client of a port nobody listens on); it
    once came out as the delete's connection error, which is raised when the body went well."""
    live = http.create_session(HKV, D, "float32")
    with AttentionClient("http://127.0.0.1:9", timeout=5.0) as gone:
        s = Session(gone, live.id, 1, HKV, D, "float32")
        with pytest.raises(ZeroDivisionError):
            with s:
                raise ZeroDivisionError("the body's own error")
        with pytest.raises(AttentionServiceError) as err:
            with s:
                pass
    assert err.value.status == 503 and err.value.code == "unavailable"
    http.delete_session(live)


# ---------------------------------------------------------------- the affinity header


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_client_side_mistakes_are_named(client, http, transport):
    """A newcomer's mistakes that never reach the server get errors that say what is wrong: a step
    without a session (it once traveled as the id 'None', or failed in URL quoting), a packed step
    without q_lengths, and over gRPC a dtype its messages do not carry (a service-internal error
    type once escaped; now the client's own, INVALID_ARGUMENT, naming the dtypes)."""
    from service.client import GrpcAttentionServiceError

    c = client if transport == "grpc" else http
    q, k, v = qkv(1, 7)
    for session in (None, ""):
        with pytest.raises(TypeError, match="session must be a Session or its id"):
            c.step(session, q, k, v)
    s = c.create_session(HKV, D, "float32")
    with pytest.raises(TypeError, match="needs q_lengths"):
        c.packed_step([s], q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), None)
    assert c.get_session(s)["lengths"] == [0]
    c.delete_session(s)
    if transport == "grpc":
        with pytest.raises(GrpcAttentionServiceError) as err:
            client.attention(q.double(), k.double(), v.double())
        assert err.value.status == grpc.StatusCode.INVALID_ARGUMENT and "float16" in err.value.message
        # in a stream, such a call is not sent and its outcome is that error; the others are answered
        outcomes = dict(client.attention_stream([{"q": q, "k": k, "v": v}, {"q": q.double(), "k": k, "v": v},
                                                 {"q": q, "k": k, "v": v, "request_id": "last"}]))
        assert set(outcomes) == {"0", "1", "last"}
        assert isinstance(outcomes["1"], GrpcAttentionServiceError) and outcomes["1"].code == "invalid_input"
        torch.testing.assert_close(outcomes["0"], http.attention(q, k, v))
        assert torch.equal(outcomes["0"], outcomes["last"])


@pytest.fixture
def recording_proxy(server):
    """A proxy in front of the server, over both transports, that records each call's
    x-attnserve-session header (metadata): (HTTP URL, gRPC target, [(path, value)])."""
    import http.server
    import threading
    from concurrent import futures

    import httpx
    from conftest import free_port

    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _forward(self):
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            seen.append((self.path.split("?")[0], self.headers.get("x-attnserve-session")))
            r = httpx.request(self.command, server.url + self.path, content=body, timeout=60,
                              headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        do_GET = do_POST = do_DELETE = _forward

        def log_message(self, *args):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    upstream = grpc.insecure_channel(server.grpc_target)

    class Forward(grpc.GenericRpcHandler):
        def service(self, details):
            def unary(request: bytes, context):
                meta = dict(details.invocation_metadata)
                seen.append((details.method, meta.get("x-attnserve-session")))
                call = upstream.unary_unary(details.method)  # bytes in, bytes out
                try:
                    return call(request, timeout=60)
                except grpc.RpcError as exc:
                    context.abort(exc.code(), exc.details())
            return grpc.unary_unary_rpc_method_handler(unary)

    rpc = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Forward()])
    port = rpc.add_insecure_port("127.0.0.1:0")
    rpc.start()
    yield f"http://127.0.0.1:{web.server_port}", f"127.0.0.1:{port}", seen
    rpc.stop(0)
    upstream.close()
    web.shutdown()


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_clients_send_the_session_affinity_header(recording_proxy, transport):
    """Every session call carries x-attnserve-session (docs/deploy.md): the session's id, the
    create's too (the client names a session it is not given a name for), a packed step's first;
    with ``session_affinity`` that key on every call instead."""
    url, target, seen = recording_proxy

    def make(**kw):
        return GrpcAttentionClient(target, **kw) if transport == "grpc" else AttentionClient(url, **kw)

    with make() as c:
        a = c.create_session(HKV, D, "float32")
        b = c.create_session(HKV, D, "float32", session=f"b-{transport}")
        q, k, v = qkv(2, 7)
        c.step(a, q, k, v)
        q1, k1, v1 = (t[0].transpose(0, 1) for t in qkv(1, 8))
        c.packed_step([b, a], torch.cat([q1, q1]), torch.cat([k1, k1]), torch.cat([v1, v1]), [1, 1])
        assert c.get_session(a)["lengths"] == [3]
        c.delete_session(a)
        c.delete_session(b)
    assert [value for _, value in seen] == [a.id, b.id, a.id, b.id, a.id, a.id, b.id], seen
    assert len(a.id) == 32 and a.id != b.id
    seen.clear()
    with make(session_affinity="stack-7") as c:
        with c.session(HKV, D, "float32") as s:
            s.step(*qkv(1, 9))
    assert [value for _, value in seen] == ["stack-7"] * 3, seen


def test_a_q_only_step_of_an_empty_session_sees_no_key(client, http):
    """A q-only step before any key of its geometry is held anywhere: o = 0, lse = -inf (it was a 422
    about the cache's missing pages: "k_pages must be a torch.Tensor"), over both transports."""
    for c in (client, http):
        s = c.create_session(3, 8, "float32")  # a geometry no other test's session holds
        q = rand(1, 6, 2, 8, seed=90)
        o, lse = c.step(s, q, return_lse=True)
        assert torch.equal(o, torch.zeros_like(q)) and bool((lse == -float("inf")).all())
        assert c.get_session(s)["lengths"] == [0]
        c.delete_session(s)


@pytest.fixture(scope="module")
def small_messages(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("sessions-grpc-small"), *SERVER_ARGS, "--max-body-mb", "0.5") as s:
        with GrpcAttentionClient(s.grpc_target, timeout=60.0) as c:
            yield c


def test_a_step_whose_answer_passes_the_message_limit_appends_nothing(small_messages):
    """An answer larger than its request (many query heads a KV head, D 1, lse) over gRPC's message
    limit (--max-body-mb 0.5) is refused before the step runs: RESOURCE_EXHAUSTED naming the sizes,
    nothing appended; in a stream, in-band, and the stream goes on. (gRPC refused to send it after
    the step had appended its keys, and a stream ended there.)"""
    c = small_messages
    s = c.create_session(1, 1, "bfloat16")
    q, k, v = (rand(1, h, 400, 1, seed=91 + h).bfloat16() for h in (256, 1, 1))  # 206 KB in, 614 KB out
    err = _status(c.step, s, q, k, v, return_lse=True)
    assert err.status == grpc.StatusCode.RESOURCE_EXHAUSTED and "answer would be" in err.message, err
    assert c.get_session(s)["lengths"] == [0]
    out = dict(c.session_stream([dict(sessions=[s.id], q=q, k=k, v=v, return_lse=True),
                                 dict(sessions=[s.id], q=q[:, :, :4], k=k[:, :, :4], v=v[:, :, :4])]))
    assert isinstance(out["0"], AttentionServiceError) and out["0"].status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert out["1"].shape == (1, 256, 4, 1)
    assert c.get_session(s)["lengths"] == [4]
    o = c.step(s, q[:, :, :100], k[:, :, :100], v[:, :, :100])  # 51 KB out: answered
    assert o.shape == (1, 256, 100, 1) and c.get_session(s)["lengths"] == [104]
    c.delete_session(s)
