"""attention.v1 over gRPC against a real server (``python -m service --device cpu``): unary, streaming,
concurrency, layers, every status code of docs/api.md#errors, health and reflection.

Two servers per module: ``server`` (defaults, one BERT layer) and ``strict`` (--api-key,
--max-body-mb 2, --max-queue-size 1).
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch
from conftest import ROOT, free_port, random_qkv, run_server
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from layer_fixtures import write_bert

from service.client import GrpcAttentionClient, GrpcAttentionServiceError
from service.errors import InvalidInput
from service.grpc.codec import DEADLINE_MARGIN_S, deadline_of, tensor_from_pb, tensor_to_pb
from service.grpc.protogen import attention_stubs
from service.layers import load_layer
from service.wire.tensors import ServerTiming
from tests.helpers import assert_close_to_reference

stubs = attention_stubs()
pb, pb_grpc = stubs.attention_pb2, stubs.attention_pb2_grpc

API_KEY = "s3cret"
FAST_WARMUP = ("--warmup-shapes", "1x2x16x16")  # ready sooner; the CPU path compiles nothing per shape
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

# (B, Hq, Hkv, Nq, Nk, D): awkward sizes, each with its reason
SHAPES = [
    (1, 8, 8, 128, 128, 64),  # the benchmark's small call
    (2, 4, 2, 17, 97, 40),  # GQA 2:1, Nq != Nk, D not a power of two
    (1, 3, 1, 1, 33, 59),  # MQA, a single query row (decode), odd D
    (3, 2, 2, 5, 5, 111),  # odd everything, D > 64
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


# ---------------------------------------------------------------- helpers


def make_qkv(shape, dtype, seed):
    return random_qkv(shape, dtype, seed)



def attend_msg(q, k, v, **fields):
    return pb.AttendRequest(q=tensor_to_pb(q), k=tensor_to_pb(k), v=tensor_to_pb(v), **fields)


def status_of(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def layer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "bert"
    write_bert(folder, prefix="")  # hidden 40, 5 heads, head dim 8
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, layer_dir):
    with run_server(tmp_path_factory.mktemp("grpc"), "--layer", f"bert0={layer_dir}:0", *FAST_WARMUP) as srv:
        yield srv


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("grpc-strict"), "--api-key", API_KEY, "--max-body-mb", "2",
                    "--max-queue-size", "1", *FAST_WARMUP) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target, options=UNLIMITED) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.AttentionServiceStub(channel)


@pytest.fixture(scope="module")
def client(server):
    with GrpcAttentionClient(server.grpc_target, timeout=60.0) as c:
        yield c


# ---------------------------------------------------------------- unary


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attend_matches_reference(stub, shape, dtype):
    q, k, v = make_qkv(shape, dtype, seed=sum(shape))
    resp = stub.Attend(attend_msg(q, k, v, request_id="unary-1"), timeout=60)
    assert resp.request_id == "unary-1" and not resp.HasField("lse")
    assert_close_to_reference(tensor_from_pb(resp, "o"), q, k, v)


def test_attend_says_where_the_server_time_went(stub):
    """A unary Attend carries its server-side split (decode, the engine's queue/launch/device/return,
    encode; ms, W3C Server-Timing syntax) in the trailing metadata "server-timing", adding up to less
    than the call."""
    q, k, v = make_qkv((1, 2, 2, 16, 16, 8), torch.float32, seed=3)
    t0 = time.perf_counter()
    resp, call = stub.Attend.with_call(attend_msg(q, k, v), timeout=60)
    wall_ms = 1e3 * (time.perf_counter() - t0)
    assert_close_to_reference(tensor_from_pb(resp, "o"), q, k, v)
    phases = ServerTiming.parse(dict(call.trailing_metadata())["server-timing"])
    assert list(phases) == ["decode", "queue", "stage", "launch", "device", "return", "encode"], phases
    assert all(ms >= 0 for ms in phases.values()) and sum(phases.values()) < wall_ms, (phases, wall_ms)


def test_attend_options(stub):
    """causal, scale, kv_lengths (one row fully masked: zeros and lse -inf), return_lse, bnhd layout."""
    q, k, v = make_qkv((2, 4, 2, 9, 12, 16), torch.float32, seed=3)
    kv_lengths = torch.tensor([12, 0], dtype=torch.int32)
    msg = attend_msg(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, scale=0.3,
                     layout="bnhd", return_lse=True, kv_lengths=tensor_to_pb(kv_lengths), kernel="reference")
    resp = stub.Attend(msg, timeout=60)
    o = tensor_from_pb(resp, "o")
    assert list(o.shape) == [2, 9, 4, 16]  # bnhd in, bnhd out
    lse = tensor_from_pb(resp, "lse")
    assert_close_to_reference(o.transpose(1, 2)[:1], q[:1], k[:1], v[:1], causal=True, scale=0.3, lse=lse[:1])
    assert torch.all(o[1] == 0) and torch.all(lse[1] == float("-inf"))
    assert resp.request_id  # the server made one up


def test_client_matches_reference(client):
    q, k, v = make_qkv((2, 4, 2, 17, 97, 40), torch.float16, seed=5)
    o, lse = client.attention(q, k, v, causal=True, return_lse=True)
    assert_close_to_reference(o, q, k, v, causal=True, lse=lse)
    o[0, 0, 0, 0] = 1.0  # the client's tensors are the caller's to write


def test_messages_over_grpc_default_4mib(client):
    """15 MiB in, 5 MiB out: the server's limits come from --max-body-mb (1 GiB), not gRPC's 4 MiB."""
    q, k, v = make_qkv((160, 8, 8, 16, 16, 64), torch.float32, seed=4)
    assert_close_to_reference(client.attention(q, k, v), q, k, v)


def test_concurrent_unary_calls(client):
    """16 threads x 3 calls on one channel; every answer equals its own reference."""
    def work(i):
        shape = SHAPES[i % len(SHAPES)]
        q, k, v = make_qkv(shape, DTYPES[i % 3], seed=100 + i)
        causal = i % 2 == 1
        for _ in range(3):
            assert_close_to_reference(client.attention(q, k, v, causal=causal), q, k, v, causal=causal)
        return i

    with ThreadPoolExecutor(16) as pool:
        assert sorted(pool.map(work, range(16))) == list(range(16))


# ---------------------------------------------------------------- streaming


def test_stream_dozens_of_calls(stub):
    """48 calls on one AttendStream, mixed shapes/dtypes/options; answers tagged, each checked alone."""
    rng = random.Random(0)
    cases = {}
    for i in range(48):
        shape, dtype = rng.choice(SHAPES), rng.choice(DTYPES)
        q, k, v = make_qkv(shape, dtype, seed=1000 + i)
        cases[f"call-{i}"] = (q, k, v, rng.random() < 0.5)
    requests = (attend_msg(q, k, v, causal=c, request_id=rid) for rid, (q, k, v, c) in cases.items())
    seen = []
    for resp in stub.AttendStream(requests, timeout=120):
        q, k, v, causal = cases[resp.request_id]
        assert_close_to_reference(tensor_from_pb(resp, "o"), q, k, v, causal=causal)
        seen.append(resp.request_id)
    assert sorted(seen) == sorted(cases)


def test_stream_helper_assigns_ids(client):
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=9)
    got = dict(client.attention_stream([{"q": q, "k": k, "v": v, "return_lse": i == 3} for i in range(6)]))
    assert sorted(got) == [str(i) for i in range(6)]
    o, lse = got["3"]
    assert_close_to_reference(o, q, k, v, lse=lse)
    assert_close_to_reference(got["0"], q, k, v)


def _bad_stream_calls():
    """Calls that fail on their own: (message, expected gRPC status name, service code, text in message)."""
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=11)
    big_d = make_qkv((1, 1, 1, 4, 4, 300), torch.float16, seed=0)
    return [
        (attend_msg(q, k[:, :, :, :8], v), "INVALID_ARGUMENT", "invalid_input", ""),  # wrong shape
        (attend_msg(*big_d), "INVALID_ARGUMENT", "invalid_input", "256"),
        (attend_msg(q, k, v, kernel="fastest"), "INVALID_ARGUMENT", "bad_request", "fastest"),
        (pb.AttendRequest(q=tensor_to_pb(q), v=tensor_to_pb(v)), "INVALID_ARGUMENT", "bad_request", "'k'"),
    ]


def test_stream_bad_calls_answered_in_band(stub):
    """40 calls on one stream, a few bad ones mixed in: every good call gets its right answer, every bad
    one an in-band error equal to what Attend would end with, and the stream ends normally (OK)."""
    rng = random.Random(1)
    bad = _bad_stream_calls()
    good, wrong, order = {}, {}, []
    for i in range(40):
        rid = f"call-{i}"
        if i % 9 == 4:  # calls 4, 13, 22, 31: one of each kind of bad call
            msg, status, code, text = bad[len(wrong)]
            msg.request_id = rid
            wrong[rid] = (msg, status, code, text)
        else:
            shape, dtype = rng.choice(SHAPES), rng.choice(DTYPES)
            q, k, v = make_qkv(shape, dtype, seed=2000 + i)
            good[rid] = (q, k, v, i % 2 == 0)
            msg = attend_msg(q, k, v, causal=i % 2 == 0, return_lse=i % 3 == 0, request_id=rid)
        order.append(msg)
    call = stub.AttendStream(iter(order), timeout=120)
    seen = []
    for resp in call:
        seen.append(resp.request_id)
        if resp.request_id in good:
            q, k, v, causal = good[resp.request_id]
            assert not resp.HasField("error")
            lse = tensor_from_pb(resp, "lse") if resp.HasField("lse") else None
            assert_close_to_reference(tensor_from_pb(resp, "o"), q, k, v, causal=causal, lse=lse)
            continue
        msg, status, code, text = wrong[resp.request_id]
        assert resp.HasField("error") and not resp.HasField("o") and not resp.HasField("lse")
        err = resp.error
        assert (err.status, err.code) == (status, code) and text in err.message, err
        assert not err.HasField("retry_after_s") and "Traceback" not in err.message
        unary = status_of(stub.Attend, msg, timeout=60)  # the same as Attend's status and trailer
        assert unary.code().name == err.status and unary.details() == err.message
        assert dict(unary.trailing_metadata())["attnserve-error-code"] == err.code
    assert sorted(seen) == sorted(m.request_id for m in order)  # one answer per call
    assert call.code() == grpc.StatusCode.OK


def test_stream_helper_yields_errors_in_place(client):
    """attention_stream yields a failed call's GrpcAttentionServiceError in place of its result."""
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=12)
    calls = [{"q": q, "k": k, "v": v, "causal": True} for _ in range(10)]
    calls[2] = {**calls[2], "kernel": "fastest"}
    calls[7] = {"q": q, "k": k[..., :8], "v": v, "request_id": "mine"}
    got = dict(client.attention_stream(calls))
    assert sorted(got) == sorted([str(i) for i in range(10) if i != 7] + ["mine"])
    for rid, outcome in got.items():
        if rid in ("2", "mine"):
            assert isinstance(outcome, GrpcAttentionServiceError)
            assert outcome.status == grpc.StatusCode.INVALID_ARGUMENT and outcome.message
        else:
            assert_close_to_reference(outcome, q, k, v, causal=True)
    assert got["2"].code == "bad_request" and "fastest" in got["2"].message
    assert got["mine"].code == "invalid_input"


def test_stream_queue_full_in_band(strict):
    """--max-queue-size 1: a stream alone keeps at most that many calls in flight, so its 8 slow
    calls all come back answered (with 64 in flight it once filled the queue with its own calls and
    got queue_full for them). Two streams at once fill it for each other: some calls come back
    queue_full (with retry-after) in-band, the rest with their answers; both streams finish."""
    q, k, v = make_qkv((1, 4, 4, 2048, 2048, 16), torch.float32, seed=0)  # 1.5 MiB, ~0.1 s each
    calls = [{"q": q, "k": k, "v": v, "kernel": "reference"} for _ in range(8)]
    with GrpcAttentionClient(strict.grpc_target, api_key=API_KEY) as c:
        alone = dict(c.attention_stream(iter(calls)))
    assert sorted(alone) == [str(i) for i in range(8)]
    assert not any(isinstance(o, GrpcAttentionServiceError) for o in alone.values()), alone
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        def stream(_):
            with GrpcAttentionClient(strict.grpc_target, api_key=API_KEY) as c:
                return dict(c.attention_stream(iter(calls)))
        streams = list(pool.map(stream, range(2)))
    assert all(sorted(got) == [str(i) for i in range(8)] for got in streams)
    got = {f"{i}.{rid}": o for i, s in enumerate(streams) for rid, o in s.items()}
    refused = [o for o in got.values() if isinstance(o, GrpcAttentionServiceError)]
    assert refused and len(refused) < 16, got
    for err in refused:
        assert (err.status, err.code) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full")
        assert err.retry_after_s is not None and err.retry_after_s > 0
    o = next(o for o in got.values() if not isinstance(o, GrpcAttentionServiceError))
    assert o.shape == q.shape and torch.isfinite(o).all()


def test_stream_whose_answers_are_not_read_stops_being_read(server, stub):
    """A client that sends 400 calls on one AttendStream (384 KiB in, 128 KiB out) and reads no
    answer: the server reads its window (64) and what HTTP/2's buffers hold, then stops (it once
    freed a slot when a call finished, read all 400 and kept their answers). Then the stream is
    cancelled and the server answers the next call."""
    q, k, v = make_qkv((1, 1, 1, 2048, 2048, 16), torch.float32, seed=3)
    message = attend_msg(q, k, v, kernel="reference")
    drawn = [0]

    def requests():
        for _ in range(400):
            drawn[0] += 1
            yield message

    call = stub.AttendStream(requests(), timeout=120)
    last, still = -1, 0
    for _ in range(300):  # until the count holds for 1.5 s (it stops, or reaches 400 without the push-back)
        time.sleep(0.05)
        still = still + 1 if drawn[0] == last else 0
        last = drawn[0]
        if still == 30 or last == 400:
            break
    call.cancel()
    # stopped: the count held before 400 (how far it got depends on HTTP/2's windows, which grpc
    # grows with the link's measured bandwidth-delay product: 204 was seen on a loaded box)
    assert still == 30 and last < 400, f"the server read {last} of 400 calls whose answers were not read"
    assert_close_to_reference(tensor_from_pb(stub.Attend(message, timeout=60), "o"), q, k, v)


# ---------------------------------------------------------------- layers


def test_list_and_call_layer(client, stub, layer_dir):
    [info] = client.layers()
    assert info == {"name": "bert0", "family": "bert", "hidden_size": 40, "num_heads": 5, "num_kv_heads": 5,
                    "head_dim": 8, "dtype": "float32"}
    x = torch.randn(2, 7, 40, generator=torch.Generator().manual_seed(1))
    y = client.call_layer("bert0", x)
    expected = load_layer("bert0", layer_dir, 0).to("cpu").forward(x, kernel="reference")
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    resp = stub.CallLayer(pb.LayerRequest(layer="bert0", x=tensor_to_pb(x), causal=True, request_id="L"))
    assert resp.request_id == "L" and list(resp.y.shape) == [2, 7, 40]


# ---------------------------------------------------------------- errors (docs/api.md#errors)


def _bad_requests():
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=0)
    half = tensor_to_pb(q)
    half.data = half.data[: len(half.data) // 2]
    no_dtype = tensor_to_pb(q)
    no_dtype.dtype = pb.DTYPE_UNSPECIFIED
    big_d = make_qkv((1, 1, 1, 4, 4, 300), torch.float16, seed=0)
    return {
        "missing k": pb.AttendRequest(q=tensor_to_pb(q), v=tensor_to_pb(v)),
        "bytes do not match shape": pb.AttendRequest(q=half, k=tensor_to_pb(k), v=tensor_to_pb(v)),
        "dtype unspecified": pb.AttendRequest(q=no_dtype, k=tensor_to_pb(k), v=tensor_to_pb(v)),
        "unknown layout": attend_msg(q, k, v, layout="nhbd"),
        "bnhd with 3-d tensors": attend_msg(q[0], k[0], v[0], layout="bnhd"),
        "unknown kernel": attend_msg(q, k, v, kernel="fastest"),
        "q not 4-d": attend_msg(q[0], k, v),
        "mixed dtypes": attend_msg(q, k.half(), v),
        "heads not a multiple": attend_msg(make_qkv((1, 3, 2, 8, 8, 16), torch.float32, 0)[0], k, v),
        "head dim over 256": attend_msg(*big_d),
        "int32 queries": attend_msg(q.int(), k.int(), v.int()),
    }


@pytest.mark.parametrize("case", list(_bad_requests()))
def test_invalid_argument(stub, case):
    err = status_of(stub.Attend, _bad_requests()[case], timeout=60)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details() and "Traceback" not in err.details()


@pytest.mark.parametrize("method", [
    "/attention.v1.AttentionService/Attend",
    "/attention.v1.AttentionService/CallLayer",
    "/inference.GRPCInferenceService/ModelInfer",
])
@pytest.mark.parametrize("size", [3, 3 << 20], ids=["small", "big"])  # big ones parse in a thread
def test_unparsable_message_is_invalid_argument(channel, method, size):
    err = status_of(channel.unary_unary(method), b"\xff" * size, timeout=10)  # raw bytes, not protobuf
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in err.details()


def test_unparsable_message_on_a_stream(channel):
    """A message that does not parse has no readable request_id: it ends the stream (INVALID_ARGUMENT,
    naming its position), after the calls read before it have been answered."""
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=13)
    good = [attend_msg(q, k, v, request_id=f"g{i}").SerializeToString() for i in range(2)]
    stream = channel.stream_stream("/attention.v1.AttentionService/AttendStream")
    call = stream(iter([*good, b"\xff" * (3 << 20)]), timeout=10)
    answered = []
    with pytest.raises(grpc.RpcError):
        for raw in call:
            answered.append(pb.AttendResponse.FromString(raw).request_id)
    assert call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "#2" in call.details() and "does not parse" in call.details()
    assert sorted(answered) == ["g0", "g1"]


def test_head_dim_message_is_actionable(client):
    q, k, v = make_qkv((1, 1, 1, 4, 4, 300), torch.float16, seed=0)
    with pytest.raises(GrpcAttentionServiceError) as info:
        client.attention(q, k, v)
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT and info.value.code == "invalid_input"
    assert "256" in info.value.message


def test_unknown_layer_is_not_found(stub, client):
    x = torch.zeros(1, 2, 40)
    err = status_of(stub.CallLayer, pb.LayerRequest(layer="nope", x=tensor_to_pb(x)), timeout=60)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.details()
    with pytest.raises(GrpcAttentionServiceError) as info:
        client.call_layer("bert0", torch.zeros(1, 2, 41))  # wrong hidden size
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline_exceeded(stub, client):
    q, k, v = make_qkv((1, 16, 16, 2048, 2048, 64), torch.float32, seed=0)  # ~1 s of CPU work
    err = status_of(stub.Attend, attend_msg(q, k, v, kernel="reference"), timeout=0.05)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    small = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=1)
    assert_close_to_reference(client.attention(*small), *small)  # the server carries on


def test_grpc_deadline_becomes_the_request_deadline():
    class Context:
        def __init__(self, remaining):
            self.remaining = remaining

        def time_remaining(self):
            return self.remaining

    before = time.monotonic()
    margin = DEADLINE_MARGIN_S  # the server's deadline comes first: the client's timer never beats a kept step
    assert 0 < margin and before + 2.0 - margin <= deadline_of(Context(2.0)) <= time.monotonic() + 2.0 - margin
    assert deadline_of(Context(None)) is None  # the engine applies --request-timeout-ms
    assert deadline_of(Context(margin / 2)) <= time.monotonic()  # passed already: never launched


def test_options_are_read_and_refused_as_over_http(stub, client):
    """An option of the wrong kind gets the code and the words the HTTP routes give it: from the
    server (a raw message: a NaN scale, a negative layer) and from the client, which reads each
    option as the server reads it ("false" is false) and refuses the rest before sending."""
    q, k, v = make_qkv((1, 2, 1, 3, 3, 4), torch.float32, seed=0)
    err = status_of(stub.Attend, attend_msg(q, k, v, scale=float("nan")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.trailing_metadata())["attnserve-error-code"] == "bad_request"
    assert "option 'scale' must be finite" in err.details()
    err = status_of(stub.SessionAttend, pb.SessionAttendRequest(sessions=["s"], layer=-1, q=tensor_to_pb(q)))
    assert dict(err.trailing_metadata())["attnserve-error-code"] == "bad_request"
    assert "option 'layer' must be an integer >= 0, got -1" in err.details()
    assert torch.equal(client.attention(q, k, v, causal="false"), client.attention(q, k, v, causal=False))
    for bad, words in ((dict(window_size=(1.5, 0)), "'window_size' must be two integers"),
                       (dict(causal="maybe"), "'causal' must be a boolean"), (dict(softcap=-1.0), "'softcap'")):
        with pytest.raises(GrpcAttentionServiceError) as info:
            client.attention(q, k, v, **bad)
        assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT and info.value.code == "bad_request"
        assert words in info.value.message
    with client.session(num_kv_heads=1, head_dim=4, dtype=torch.float32) as session:
        with pytest.raises(GrpcAttentionServiceError, match="'layer' must be an integer >= 0, got 1.5"):
            session.step(q, k, v, layer=1.5)
        assert session.info()["lengths"] == [0]


def test_a_closed_client_and_a_broken_request_iterator(server):
    """After close() ready() is False and a call raises UNAVAILABLE saying so; a request iterator
    that raises mid-stream ends the stream: the calls sent are answered, then its own error."""
    q, k, v = make_qkv((1, 1, 1, 2, 2, 4), torch.float32, seed=1)
    c = GrpcAttentionClient(server.grpc_target)

    def items():
        yield {"q": q, "k": k, "v": v}
        raise RuntimeError("the caller's generator broke")

    got = []
    with pytest.raises(RuntimeError, match="the caller's generator broke"):
        for rid, outcome in c.attention_stream(items()):
            got.append(rid)
            assert torch.equal(outcome, c.attention(q, k, v))
    assert got == ["0"]
    c.close()
    assert c.ready() is False
    with pytest.raises(GrpcAttentionServiceError, match="this client is closed") as info:
        c.attention(q, k, v)
    assert info.value.status == grpc.StatusCode.UNAVAILABLE


def test_unavailable_when_nothing_listens():
    with GrpcAttentionClient(f"127.0.0.1:{free_port()}", timeout=5.0) as c:
        assert c.ready() is False
        with pytest.raises(GrpcAttentionServiceError) as info:
            c.attention(*make_qkv((1, 1, 1, 2, 2, 4), torch.float32, seed=0))
    assert info.value.status == grpc.StatusCode.UNAVAILABLE


def test_message_over_limit_is_resource_exhausted(strict):
    with GrpcAttentionClient(strict.grpc_target, api_key=API_KEY) as c:
        q, k, v = make_qkv((1, 8, 8, 4096, 4096, 16), torch.float16, seed=0)  # 3 x 1 MiB > 2 MiB
        with pytest.raises(GrpcAttentionServiceError) as info:
            c.attention(q, k, v)
    assert info.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_queue_full_is_resource_exhausted(strict):
    """--max-queue-size 1: of several concurrent slow calls, some are refused with queue_full."""
    q, k, v = make_qkv((1, 4, 4, 2048, 2048, 16), torch.float32, seed=0)  # 1.5 MiB, ~0.1 s each
    outcomes = []
    lock = threading.Lock()
    with GrpcAttentionClient(strict.grpc_target, api_key=API_KEY) as c:
        def call(_):
            try:
                c.attention(q, k, v, kernel="reference")
                out = "ok"
            except GrpcAttentionServiceError as exc:
                out = (exc.status, exc.code, exc.retry_after_s)
            with lock:
                outcomes.append(out)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(call, range(8)))
    refused = [o for o in outcomes if o != "ok"]
    assert "ok" in outcomes and refused, outcomes
    for status, code, _retry in refused:
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED and code == "queue_full"


def test_api_key(strict):
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=0)
    for key in (None, "wrong"):
        with GrpcAttentionClient(strict.grpc_target, api_key=key) as c:
            with pytest.raises(GrpcAttentionServiceError) as info:
                c.attention(q, k, v)
            assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(GrpcAttentionServiceError) as info:
                list(c.attention_stream([{"q": q, "k": k, "v": v}]))
            assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
            assert c.ready() is True  # health is exempt
    with GrpcAttentionClient(strict.grpc_target, api_key=API_KEY) as c:
        assert_close_to_reference(c.attention(q, k, v), q, k, v)
    # a good call first, then a wrong key: the key is checked on every call
    with GrpcAttentionClient(strict.grpc_target, api_key="wrong") as c:
        with pytest.raises(GrpcAttentionServiceError) as info:
            c.attention(q, k, v)
        assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(strict.grpc_target) as ch:  # reflection is exempt too
        assert "attention.v1.AttentionService" in list_services(ch)


# ---------------------------------------------------------------- health and reflection


def test_health_serving_once_ready(channel):
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "attention.v1.AttentionService", "inference.GRPCInferenceService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == serving
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watch).status == serving
    watch.cancel()


def test_health_follows_warmup_and_drain(tmp_path):
    """NOT_SERVING (and UNAVAILABLE calls) while warming, SERVING once warm, NOT_SERVING on SIGTERM
    while a held call still completes, then a prompt exit."""
    NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    eager = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
             ("grpc.max_reconnect_backoff_ms", 100)]  # connect as soon as the port listens
    with run_server(tmp_path, "--warmup-shapes", "1x16x2048x64", wait_ready=False) as srv, \
            grpc.insecure_channel(srv.grpc_target, options=eager + UNLIMITED) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = pb_grpc.AttentionServiceStub(ch)
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        first = next(watch).status
        if first == NOT_SERVING:  # still warming (the usual case): calls are refused meanwhile
            q, k, v = make_qkv((1, 1, 1, 2, 2, 4), torch.float32, seed=0)
            try:
                stub.Attend(attend_msg(q, k, v), timeout=10)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            # else: the CPU warm-up (milliseconds) can end between the watch's answer and the
            # call. The refusal itself is tested on the engine
            # (test_engine.py); its status comes from Unavailable.grpc_code, the one mapping that
            # every error of this file goes through.
            assert next(watch).status == SERVING
        else:
            assert first == SERVING
        big = make_qkv((1, 16, 16, 1024, 1024, 64), torch.float32, seed=0)
        held = stub.Attend.future(attend_msg(*big, kernel="reference"), timeout=60)
        wait_until_held(srv)  # the call has reached the engine
        srv.proc.terminate()
        assert next(watch).status == NOT_SERVING
        assert list(watch) == []  # the watch ends, so it does not hold the shutdown
        assert_close_to_reference(tensor_from_pb(held.result(), "o"), *big)  # drained, not dropped
        assert srv.proc.wait(timeout=20) == 0


def wait_until_held(srv, timeout: float = 30.0) -> None:
    """Until the server's engine holds a request (its pending-requests gauge, read from /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(srv.url + "/metrics", timeout=5).text
        held = [line for line in text.splitlines() if line.startswith("attnserve_inference_pending_requests ")]
        if held and float(held[0].split()[1]) >= 1:
            return
        time.sleep(0.02)
    raise TimeoutError("the request never reached the engine")


def list_services(ch) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    [resp] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                       timeout=10)
    return [s.name for s in resp.list_services_response.service]


def test_docs_grpcurl_payload(stub):
    """The JSON body of docs/grpc.md's grpcurl example is a valid AttendRequest with the stated tensors."""
    text = (ROOT / "docs" / "grpc.md").read_text()
    tensor = re.search(r"^T='(.*)'$", text, re.M).group(1)
    body = re.search(r'-d "(\{.*\})"', text).group(1).replace('\\"', '"').replace("$T", tensor)
    resp = stub.Attend(json_format.Parse(body, pb.AttendRequest()), timeout=10)
    q = torch.tensor([[[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]]])
    assert resp.request_id == "r1"
    o, lse = tensor_from_pb(resp, "o"), tensor_from_pb(resp, "lse")
    assert_close_to_reference(o, q, q, q, causal=True, lse=lse)


def test_reflection(channel):
    assert set(list_services(channel)) >= {
        "attention.v1.AttentionService", "inference.GRPCInferenceService", "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="attention.v1.AttentionService")
    [resp] = stub.ServerReflectionInfo(iter([req]), timeout=10)
    assert resp.file_descriptor_response.file_descriptor_proto  # what grpcurl needs to build requests


def test_declared_bytes_are_the_tensors_bytes():
    """What decides whether a request is converted off the event loop: the bytes its tensors
    declare (shape x dtype size) on attention.v1 and OIP messages, without serializing them; the
    benchmark's small call (1x8x128x64 fp16, 384 KiB) stays inline."""
    from tritonclient.grpc import service_pb2 as tpb  # tritonclient's messages: see service.grpc.protogen

    from service.grpc.codec import OFFLOAD_BYTES, declared_bytes

    q, k, v = random_qkv((1, 8, 8, 128, 128, 64), torch.float16, 0)
    msg = pb.AttendRequest(q=tensor_to_pb(q), k=tensor_to_pb(k), v=tensor_to_pb(v))
    # + the unset kv_lengths and alibi_slopes: shape [], one element each
    assert declared_bytes(msg) == 3 * q.numel() * 2 + 2 * 4
    assert declared_bytes(msg) < OFFLOAD_BYTES
    big = pb.SessionAttendRequest(sessions=["s"], q=tensor_to_pb(torch.zeros(600, 32, 128)))
    assert declared_bytes(big) == 600 * 32 * 128 * 4 + 4 * 4 > OFFLOAD_BYTES  # unset k, v, q_lengths, alibi_slopes
    req = tpb.ModelInferRequest(model_name="attention")
    req.inputs.add(name="q", datatype="FP16", shape=[1, 2, 3, 4])
    req.inputs.add(name="k", datatype="FP32", shape=[1, 2, 3, 4])
    assert declared_bytes(req) == 24 * 2 + 24 * 4


def test_with_tensors_builds_the_message_the_constructor_builds():
    """``with_tensors`` writes tensors into a message in place: the same bytes on the wire as the
    message built from ``tensor_to_pb`` parts, None leaves a field unset, and a dtype the wire has
    no name for is refused before anything is written."""
    from service.grpc.codec import with_tensors

    q, k, v = random_qkv((1, 3, 1, 5, 7, 16), torch.bfloat16, 3)
    lengths = torch.tensor([5], dtype=torch.int32)
    built = with_tensors(pb.AttendRequest(causal=True, request_id="r"), q=q, k=k, v=v, kv_lengths=lengths,
                         alibi_slopes=None)
    expected = pb.AttendRequest(q=tensor_to_pb(q), k=tensor_to_pb(k), v=tensor_to_pb(v),
                                kv_lengths=tensor_to_pb(lengths), causal=True, request_id="r")
    assert built.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    assert not built.HasField("alibi_slopes")
    assert torch.equal(tensor_from_pb(built, "k"), k)
    with pytest.raises(InvalidInput, match="cannot travel"):
        with_tensors(pb.AttendRequest(), q=torch.zeros(2, dtype=torch.complex64))


def test_grpc_floor_bench_measures_every_server_kind():
    """``python -m bench.grpc_floor``: each server kind answers its echo at every size (checked by
    the bench: the bytes the request asked for back), and the table has a row each."""
    from bench import grpc_floor

    proc = subprocess.run([sys.executable, "-m", "bench.grpc_floor", "--iters", "20", "--kinds", "asyncio,sync"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()[2:]]
    assert [(k, c, int(n), int(a)) for k, c, n, a, *_ in rows] == [
        (k, "python", n, a) for k in ("asyncio", "sync") for n, a in grpc_floor.SIZES]
    assert all(0 < float(p50) <= float(p99) for *_, p50, p99 in rows)


def test_grpc_floor_echo_answers_what_the_request_asks():
    """The echo's framing: a request names how many of its bytes come back, in a valid Blob."""
    from bench import grpc_floor

    message = grpc_floor.request(300, 17)
    assert len(grpc_floor.blob_data(message)) == 300
    answer = grpc_floor._answer(message)
    assert bytes(grpc_floor.blob_data(answer)) == bytes(grpc_floor.blob_data(message)[:17])
    assert grpc_floor.blob_data(grpc_floor.blob(b"")) == b""
