"""The native HTTP API (docs/api.md#http-api, #errors) against a real server process, with real HTTP clients.

Two servers per module: ``server`` (default limits, one tiny BERT layer loaded) and ``guarded``
(--api-key, a 4 MiB body limit and --max-queue-size 1) for the 401/413/429 rows.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import math
import re
import threading
import time

import httpx
import orjson
import pytest
import safetensors.torch as st
import torch
import torch.nn.functional as F

from service.client import AttentionClient, AttentionServiceError
from tests.conftest import FAST, random_qkv, run_server
from tests.helpers import attention64, plain_pytorch
from tests.layer_fixtures import block

API_KEY = "s3cret-key"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (B, Hq, Hkv, Nq, Nk, D): why each shape is here
SHAPES = [
    (1, 2, 2, 5, 7, 8),  # tiny, Nq != Nk
    (2, 4, 2, 17, 17, 40),  # GQA, odd N, non-power-of-two D
    (1, 3, 1, 1, 33, 59),  # MQA, a single query, odd D
    (2, 2, 2, 33, 9, 16),  # Nq > Nk: causal rows that see no key
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_bert):
    with run_server(tmp_path_factory.mktemp("server"), *FAST, "--layer", f"tiny={tiny_bert[0]}:0") as s:
        yield s


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    with run_server(
        tmp_path_factory.mktemp("guarded"),
        *FAST,
        "--api-key",
        API_KEY,
        "--max-body-mb",
        "4",
        "--max-json-mb",
        "1",
        "--max-queue-size",
        "1",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


make = random_qkv



def assert_matches(o, q, k, v, lse=None, **opts):
    """Error budget relative to PyTorch: at most 2x plain PyTorch's error in q's dtype, plus one unit
    of that dtype (the server may batch, and its CPU path rounds like a GPU kernel)."""
    o64, lse64 = attention64(q, k, v, **opts)
    plain_err = (plain_pytorch(q, k, v, **opts).double() - o64).abs().max().item()
    err = (o.double() - o64).abs().max().item()
    assert o.dtype == q.dtype and o.shape == q.shape
    # floor: one unit of q's dtype at the output's magnitude (a mixed-up answer is off by ~0.1-1)
    floor = torch.finfo(q.dtype).eps * max(1.0, o64.abs().max().item())
    assert err <= 2 * plain_err + floor, f"error {err} vs plain PyTorch's {plain_err}"
    if lse is not None:
        finite = torch.isfinite(lse64)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse.double()[finite] - lse64[finite]).abs().max().item() <= 1e-4


def post_st(http, tensors, params=None, headers=None, path="/attention"):
    return http.post(
        path,
        content=st.save({k: t.contiguous() for k, t in tensors.items()}),
        params=params or {},
        headers={"Content-Type": "application/x-safetensors", **(headers or {})},
    )


def assert_error(r, status, code=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if code:
        assert err["code"] == code
    return err


def still_serving(url):
    q, k, v = make(SHAPES[0])
    r = httpx.post(
        url + "/attention",
        content=st.save({"q": q, "k": k, "v": v}),
        headers={"Content-Type": "application/x-safetensors", "X-API-Key": API_KEY},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert_matches(st.load(r.content)["o"], q, k, v)


# ---------------------------------------------------------------- results


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_safetensors_matches_reference(http, shape, dtype, layout):
    q, k, v = make(shape, DTYPES[dtype])
    causal = shape[3] != shape[4]
    kv_lengths = torch.tensor([max(1, shape[4] - 3 * i) for i in range(shape[0])], dtype=torch.int32)
    wire = {"q": q, "k": k, "v": v, "kv_lengths": kv_lengths}
    if layout == "bnhd":  # flash-attn's (B, N, H, D)
        wire.update({n: t.transpose(1, 2).contiguous() for n, t in (("q", q), ("k", k), ("v", v))})
    r = post_st(http, wire, {"causal": str(causal).lower(), "return_lse": "true", "layout": layout})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-safetensors"
    out = st.load(r.content)
    o = out["o"].transpose(1, 2) if layout == "bnhd" else out["o"]
    assert out["lse"].dtype == torch.float32 and out["lse"].shape == q.shape[:3]
    assert_matches(o, q, k, v, out["lse"], causal=causal, kv_lengths=kv_lengths)


def test_options_from_metadata_and_query_wins(http):
    q, k, v = make(SHAPES[3])
    body = st.save({"q": q, "k": k, "v": v}, metadata={"causal": "true", "scale": "0.5", "format": "pt"})
    headers = {"Content-Type": "application/x-safetensors"}
    r = http.post("/attention", content=body, headers=headers)
    assert_matches(st.load(r.content)["o"], q, k, v, causal=True, scale=0.5)
    r = http.post("/attention", content=body, headers=headers, params={"causal": "false"})
    assert_matches(st.load(r.content)["o"], q, k, v, causal=False, scale=0.5)


def _tensor_json(t, encoding):
    if encoding == "list":
        return t.tolist()
    if encoding == "flat":
        return {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "data": t.float().reshape(-1).tolist() if t.dtype.is_floating_point else t.reshape(-1).tolist(),
        }
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "data": base64.b64encode(raw).decode(),
    }


def _denull(x):
    return [_denull(i) for i in x] if isinstance(x, list) else (-math.inf if x is None else x)


def _tensor_from_json(value, encoding):
    if encoding == "list":
        return torch.tensor(_denull(value))
    dtype = DTYPES[value["dtype"]]
    if encoding == "flat":
        return torch.tensor(_denull(value["data"])).to(dtype).reshape(value["shape"])
    raw = bytearray(base64.b64decode(value["data"]))
    t = torch.frombuffer(raw, dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return (t.view(torch.bfloat16) if dtype == torch.bfloat16 else t).reshape(value["shape"])


@pytest.mark.parametrize(
    "encoding,dtype",
    [
        ("list", "float32"),
        ("flat", "float16"),
        ("flat", "float32"),
        ("base64", "bfloat16"),
        ("base64", "float32"),
    ],
)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_json_encodings(http, encoding, dtype, layout):
    shape = SHAPES[1]
    q, k, v = make(shape, DTYPES[dtype] if encoding != "list" else torch.float32)
    kv_lengths = torch.tensor([0, 11], dtype=torch.int32)  # batch 0 sees no key: o = 0, lse = -inf
    wq, wk, wv = (t.transpose(1, 2).contiguous() if layout == "bnhd" else t for t in (q, k, v))
    doc = {
        "q": _tensor_json(wq, encoding),
        "k": _tensor_json(wk, encoding),
        "v": _tensor_json(wv, encoding),
        "kv_lengths": kv_lengths.tolist(),
        "return_lse": True,
        "layout": layout,
    }
    r = http.post("/attention", content=orjson.dumps(doc), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    out = r.json()
    if encoding == "list":
        assert all(x is None for x in out["lse"][0][0])  # -inf is written as null
    else:
        assert out["o"]["dtype"] == dtype and out["lse"]["dtype"] == "float32"
        assert isinstance(out["o"]["data"], str if encoding == "base64" else list)
    o = _tensor_from_json(out["o"], encoding).to(q.dtype)
    o = o.transpose(1, 2) if layout == "bnhd" else o
    lse = _tensor_from_json(out["lse"], encoding)
    assert torch.all(o[0] == 0)
    assert_matches(o, q, k, v, lse, kv_lengths=kv_lengths)


def test_concurrent_mixed_shapes(server):
    """Many concurrent requests of different shapes and options; each answer is its own."""
    cases = [
        (SHAPES[i % len(SHAPES)], [torch.float32, torch.float16, torch.bfloat16][i % 3], i % 2 == 0, i)
        for i in range(24)
    ]

    def one(case):
        shape, dtype, causal, seed = case
        q, k, v = make(shape, dtype, seed=seed)
        with AttentionClient(server.url) as c:
            o = c.attention(q, k, v, causal=causal)
        assert_matches(o, q, k, v, causal=causal)

    with cf.ThreadPoolExecutor(12) as pool:
        list(pool.map(one, cases))


def test_client_reports_an_answer_that_is_not_safetensors():
    """A 200 whose body is not a safetensors file (a proxy's page, a truncated answer) is an
    AttentionServiceError, not a crash deep in the parser; the client stays usable."""
    import http.server
    import threading

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"<html>not what you asked for</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        q, k, v = make(SHAPES[0], torch.float32)
        with AttentionClient(f"http://127.0.0.1:{httpd.server_address[1]}") as c:
            for _ in range(2):
                with pytest.raises(AttentionServiceError) as exc:
                    c.attention(q, k, v)
                assert exc.value.status == 200 and exc.value.code == "bad_answer"
    finally:
        httpd.shutdown()


def test_client_reports_a_connection_reset_mid_answer():
    """A connection reset while the answer is read (a server killed mid-answer, a proxy) is 503
    unavailable, as a clean close mid-answer is, not a bare ConnectionResetError."""
    import socket
    import struct
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        conn.recv(1 << 20)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-safetensors\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b"x" * 100)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        q, k, v = make((1, 1, 1, 2, 2, 4), torch.float32)
        with AttentionClient(f"http://127.0.0.1:{listener.getsockname()[1]}") as c, \
                pytest.raises(AttentionServiceError) as exc:
            c.attention(q, k, v)
        assert exc.value.status == 503 and exc.value.code == "unavailable", exc.value
    finally:
        listener.close()


def test_client_sends_tensors_of_any_layout_and_reads_options_as_the_server(server):
    """Tensors torch calls contiguous whose one element has another stride (expand(1), x[::2]) go
    as their values; a bool option given as text ("false") means what the server reads it as."""
    q, k, v = make((1, 2, 1, 3, 3, 4), torch.float32)
    with AttentionClient(server.url) as c:
        kv_lengths = torch.tensor(2, dtype=torch.int32).expand(1)
        assert kv_lengths.is_contiguous() and kv_lengths.stride() == (0,)
        o = c.attention(q, k, v, kv_lengths=kv_lengths)
        assert_matches(o, q, k, v, kv_lengths=torch.tensor([2], dtype=torch.int32))
        slopes = torch.tensor([0.5, 9.0, 0.25, 9.0])[::2]
        o = c.attention(q, k, v, alibi_slopes=slopes)
        assert torch.equal(o, c.attention(q, k, v, alibi_slopes=slopes.contiguous().clone()))
        assert torch.equal(c.attention(q, k, v, causal="false"), c.attention(q, k, v, causal=False))
        with pytest.raises(AttentionServiceError) as exc:
            c.attention(q, k, v, causal="maybe")
        assert exc.value.status == 400 and "'causal' must be a boolean" in exc.value.message
    with pytest.raises(ValueError, match="http:// or https://"):
        AttentionClient(server.url.removeprefix("http://"))


def test_client(server, tiny_bert):
    c = AttentionClient(server.url)
    assert c.ready()
    q, k, v = make(SHAPES[1], torch.float16)
    o, lse = c.attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        return_lse=True,
        layout="bnhd",
        scale=0.3,
        kernel="auto",
    )
    assert_matches(o.transpose(1, 2), q, k, v, lse, scale=0.3)
    # self-attention: q, k, v are one tensor (its bytes are sent three times)
    o = c.attention(q, q, q)
    assert_matches(o, q, q, q)
    o.add_(1)  # the answer is the caller's own memory: writable (a view of the client's buffer)
    [info] = c.layers()
    assert info == {
        "name": "tiny",
        "family": "bert",
        "hidden_size": 40,
        "num_heads": 5,
        "num_kv_heads": 5,
        "head_dim": 8,
        "dtype": "float32",
    }
    with pytest.raises(AttentionServiceError) as exc:
        c.attention(q, k[..., :8], v[..., :8], causal=True)
    assert exc.value.status == 422 and exc.value.code == "invalid_input" and "head dim" in exc.value.message
    with pytest.raises(AttentionServiceError) as exc:
        c.call_layer("nope", torch.zeros(1, 3, 40))
    assert exc.value.status == 404
    c.close()


def _bert_reference(tensors, x, kv_lengths=None):
    w = block(tensors, 0)
    b, n, hidden = x.shape
    heads, d = 5, hidden // 5
    q, k, v = (
        F.linear(x.double(), w[n_].double(), w[n_ + "_bias"].double()).view(b, n, heads, d).transpose(1, 2)
        for n_ in ("q", "k", "v")
    )
    o, _ = attention64(q, k, v, kv_lengths=kv_lengths)
    return F.linear(o.transpose(1, 2).reshape(b, n, hidden), w["o"].double(), w["o_bias"].double())


def test_layers(http, server, tiny_bert):
    _, tensors = tiny_bert
    assert http.get("/layers").json()["layers"][0]["name"] == "tiny"
    x = torch.randn(2, 9, 40)
    kv_lengths = torch.tensor([9, 4], dtype=torch.int32)
    r = post_st(http, {"x": x, "kv_lengths": kv_lengths}, path="/layers/tiny")
    assert r.status_code == 200, r.text
    y = st.load(r.content)["y"]
    ref = _bert_reference(tensors, x, kv_lengths)
    assert (y.double() - ref).abs().max() < 1e-4
    r = http.post("/layers/tiny", json={"x": x.tolist(), "kv_lengths": kv_lengths.tolist()})
    assert r.status_code == 200, r.text
    assert (torch.tensor(r.json()["y"]).double() - ref).abs().max() < 1e-4
    assert_error(http.post("/layers/tiny", json={"x": torch.randn(1, 3, 41).tolist()}), 422, "invalid_input")
    assert_error(http.post("/layers/tiny", json={"x": x.tolist()}, params={"scale": "1"}), 400, "bad_request")


# ---------------------------------------------------------------- errors (docs/api.md#errors), each with a JSON body


def _st(**tensors):
    return st.save({k: t.contiguous() for k, t in tensors.items()})


def _st_raw(header: dict, data: bytes) -> bytes:
    """A safetensors file from a hand-written header (which a safetensors writer would refuse)."""
    head = orjson.dumps(header)
    return len(head).to_bytes(8, "little") + head + data


Q, K, V = make(SHAPES[0])
ERRORS = [
    # (why, content-type, body, params, status, code)
    (
        "safetensors garbage",
        "application/x-safetensors",
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json",
        {},
        400,
        "bad_request",
    ),
    (
        "safetensors header length past the end",
        "application/x-safetensors",
        b"\xff" * 16,
        {},
        400,
        "bad_request",
    ),
    (
        "offsets outside the body",
        "application/x-safetensors",
        b'@\x00\x00\x00\x00\x00\x00\x00{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4000]}}       ',
        {},
        400,
        "bad_request",
    ),
    (  # the string shape "1112" must not be read as [1, 1, 1, 2]
        "safetensors shape not a list of integers",
        "application/x-safetensors",
        _st_raw({n: {"dtype": "F32", "shape": "1112", "data_offsets": [0, 8]} for n in "qkv"}, bytes(8)),
        {},
        400,
        "bad_request",
    ),
    (  # parsing a huge header takes ~10x its size in memory
        "safetensors header over 1 MiB",
        "application/x-safetensors",
        st.save({"q": Q, "k": K, "v": V}, metadata={"causal": "true" + " " * (1 << 20)}),
        {},
        413,
        "payload_too_large",
    ),
    ("JSON garbage", "application/json", b'{"q": [1, 2', {}, 400, "bad_request"),
    ("JSON not an object", "application/json", b"[1, 2, 3]", {}, 400, "bad_request"),
    (
        "ragged nested list",
        "application/json",
        orjson.dumps({"q": [[1.0], [1.0, 2.0]], "k": [[1.0]], "v": [[1.0]]}),
        {},
        400,
        "bad_request",
    ),
    (
        "bad base64",
        "application/json",
        orjson.dumps({"q": {"shape": [1], "dtype": "float32", "data": "**"}, "k": [1.0], "v": [1.0]}),
        {},
        400,
        "bad_request",
    ),
    (
        "bytes do not match the shape",
        "application/json",
        orjson.dumps(
            {"q": {"shape": [1, 1, 4, 4], "dtype": "float32", "data": "AAAAAA=="}, "k": [1.0], "v": [1.0]}
        ),
        {},
        400,
        "bad_request",
    ),
    (
        "unknown dtype",
        "application/json",
        orjson.dumps({"q": {"shape": [1], "dtype": "float8", "data": [1.0]}, "k": [1.0], "v": [1.0]}),
        {},
        400,
        "bad_request",
    ),
    ("unknown content type", "text/plain", b"q=1", {}, 415, "unsupported_media_type"),
    ("no content type", "", b"{}", {}, 415, "unsupported_media_type"),
    ("missing tensor", "application/x-safetensors", _st(q=Q, k=K), {}, 400, "bad_request"),
    (
        "unknown tensor name",
        "application/x-safetensors",
        _st(q=Q, k=K, v=V, kv_length=torch.ones(1)),
        {},
        400,
        "bad_request",
    ),
    (
        "unknown option (query typo)",
        "application/x-safetensors",
        _st(q=Q, k=K, v=V),
        {"casual": "true"},
        400,
        "bad_request",
    ),
    (
        "unknown option (JSON typo)",
        "application/json",
        orjson.dumps({"q": Q.tolist(), "k": K.tolist(), "v": V.tolist(), "casual": True}),
        {},
        400,
        "bad_request",
    ),
    (
        "bad option value",
        "application/x-safetensors",
        _st(q=Q, k=K, v=V),
        {"causal": "maybe"},
        400,
        "bad_request",
    ),
    ("bad layout", "application/x-safetensors", _st(q=Q, k=K, v=V), {"layout": "nhbd"}, 400, "bad_request"),
    ("bad kernel", "application/x-safetensors", _st(q=Q, k=K, v=V), {"kernel": "fast"}, 400, "bad_request"),
    (
        "scale not finite",
        "application/x-safetensors",
        _st(q=Q, k=K, v=V),
        {"scale": "inf"},
        400,
        "bad_request",
    ),
    (
        "inconsistent head dims",
        "application/x-safetensors",
        _st(q=Q, k=K[..., :4], v=V[..., :4]),
        {},
        422,
        "invalid_input",
    ),
    (
        "Hq not a multiple of Hkv",
        "application/x-safetensors",
        _st(q=torch.randn(1, 3, 4, 8), k=torch.randn(1, 2, 4, 8), v=torch.randn(1, 2, 4, 8)),
        {},
        422,
        "invalid_input",
    ),
    ("3-dim q", "application/x-safetensors", _st(q=Q[0], k=K, v=V), {"layout": "bnhd"}, 422, "invalid_input"),
    (
        "q, k, v of different dtypes",
        "application/x-safetensors",
        _st(q=Q.half(), k=K, v=V),
        {},
        422,
        "invalid_input",
    ),
    (
        "float64 inputs",
        "application/x-safetensors",
        _st(q=Q.double(), k=K.double(), v=V.double()),
        {},
        422,
        "invalid_input",
    ),
    (
        "head dim over 256",
        "application/x-safetensors",
        _st(q=torch.randn(1, 1, 2, 257), k=torch.randn(1, 1, 2, 257), v=torch.randn(1, 1, 2, 257)),
        {},
        422,
        "invalid_input",
    ),
    (
        "kv_lengths past Nk",
        "application/x-safetensors",
        _st(q=Q, k=K, v=V, kv_lengths=torch.tensor([99], dtype=torch.int32)),
        {},
        422,
        "invalid_input",
    ),
    (  # abs(-2**63) overflows: this must not become int32 0
        "kv_lengths -2**63",
        "application/x-safetensors",
        _st(q=Q, k=K, v=V, kv_lengths=torch.tensor([-(2**63)], dtype=torch.int64)),
        {},
        422,
        "invalid_input",
    ),
    (  # nested lists under "data" must not reach reshape() (a 500)
        "flat data holding nested lists",
        "application/json",
        orjson.dumps({"q": {"shape": [2], "data": [[1.0, 0.0], [0.0, 1.0]]}, "k": [1.0], "v": [1.0]}),
        {},
        400,
        "bad_request",
    ),
    (  # must not wrap around to kv_lengths 0 (zeros answered 200)
        "int32 data out of range",
        "application/json",
        orjson.dumps(
            {"q": Q.tolist(), "k": K.tolist(), "v": V.tolist(),
             "kv_lengths": {"shape": [1], "dtype": "int32", "data": [2**32 + 7]}}
        ),
        {},
        400,
        "bad_request",
    ),
    (  # must not be truncated to 7
        "kv_lengths with a fraction",
        "application/json",
        orjson.dumps({"q": Q.tolist(), "k": K.tolist(), "v": V.tolist(), "kv_lengths": [7.5]}),
        {},
        400,
        "bad_request",
    ),
]


@pytest.mark.parametrize("why,ctype,body,params,status,code", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_rows(http, server, why, ctype, body, params, status, code):
    r = http.post("/attention", content=body, params=params, headers={"Content-Type": ctype} if ctype else {})
    assert_error(r, status, code)


def test_unknown_layer_404(http):
    assert_error(post_st(http, {"x": torch.randn(1, 2, 40)}, path="/layers/nope"), 404, "not_found")
    assert_error(http.get("/no/such/route"), 404)
    r = http.get("/attention")
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"  # a 405 names the allowed methods (RFC 9110)


def test_deadline_504_and_request_id(server, http):
    q = torch.randn(1, 16, 2048, 32, dtype=torch.float16)  # ~1 s on a CPU
    k, v = torch.randn(1, 1, 2048, 32, dtype=torch.float16), torch.randn(1, 1, 2048, 32, dtype=torch.float16)
    t0 = time.monotonic()
    r = post_st(
        http, {"q": q, "k": k, "v": v}, headers={"X-Request-Timeout-Ms": "50", "X-Request-Id": "dl-1"}
    )
    assert_error(r, 504, "deadline_exceeded")
    assert r.headers["x-request-id"] == "dl-1"
    assert time.monotonic() - t0 < 5
    assert_error(post_st(http, {"q": Q, "k": K, "v": V}, headers={"X-Request-Timeout-Ms": "0"}), 504)
    assert_error(post_st(http, {"q": Q, "k": K, "v": V}, headers={"X-Request-Timeout-Ms": "soon"}), 400)
    assert http.get("/healthz").headers["x-request-id"]  # generated when the client sends none
    still_serving(server.url)


def test_health_metrics_docs(http):
    assert http.get("/healthz").json() == {"status": "alive"}
    assert http.get("/readyz").status_code == 200
    for probe in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):  # load balancers send HEAD
        r = http.head(probe)
        assert r.status_code == 200 and r.content == b"", (probe, r.status_code)
    post_st(http, {"q": Q, "k": K, "v": V})
    text = http.get("/metrics").text
    assert any(
        line.startswith("attnserve_http_requests_total{")
        and all(label in line for label in ('route="/attention"', 'method="POST"', 'status="200"'))
        for line in text.splitlines()
    )
    assert "attnserve_inference_request_success_total" in text  # the engine's own registry
    assert http.get("/docs").status_code == 200
    schema = http.get("/openapi.json").json()
    body = schema["paths"]["/attention"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/x-safetensors"}
    assert "AttentionJSON" in schema["components"]["schemas"]
    for path, json_schema in (("/sessions/{session}/attend", "SessionStepJSON"), ("/sessions/attend", "PackedStepJSON"),
                              ("/sessions", "SessionCreate")):
        content = schema["paths"][path]["post"]["requestBody"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith("/" + json_schema), path
        assert json_schema in schema["components"]["schemas"]
    refs = re.findall(r'"\$ref":\s*"#/components/schemas/(\w+)"', orjson.dumps(schema).decode())
    assert set(refs) <= set(schema["components"]["schemas"]), set(refs) - set(schema["components"]["schemas"])


# ---------------------------------------------------------------- guarded server: 401, 413, 429


def _http_requests(url):
    metrics = httpx.get(url + "/metrics", headers={"X-API-Key": API_KEY}).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
            if line.startswith("attnserve_http_requests_total{")}


def test_api_key_401(guarded):
    url = guarded.url
    before = _http_requests(url)
    body, headers = _st(q=Q, k=K, v=V), {"Content-Type": "application/x-safetensors"}
    for extra in ({}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url + "/attention", content=body, headers={**headers, **extra})
        assert_error(r, 401, "unauthenticated")
    assert_error(httpx.get(url + "/layers"), 401)
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/v2/models/attention").json() == {
        "error": "an API key is required: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'"
    }
    for probe in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
        assert httpx.get(url + probe).status_code == 200
    for extra in ({"X-API-Key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert httpx.post(url + "/attention", content=body, headers={**headers, **extra}).status_code == 200
    with AttentionClient(url, api_key=API_KEY) as c:
        assert_matches(c.attention(Q, K, V), Q, K, V)
    # the refusals are counted under the routes they were for (the key is checked before routing)
    after = _http_requests(url)
    for series, calls in (('{method="POST",route="/attention",status="401"}', 4),
                          ('{method="GET",route="/layers",status="401"}', 1)):
        name = "attnserve_http_requests_total" + series
        assert after.get(name, 0) - before.get(name, 0) == calls, (name, after)


def test_body_limit_413(guarded):
    big = torch.zeros(1, 1, 1024, 1024)  # 4 MiB each: over the 4 MiB limit together
    body = _st(q=big, k=big.clone(), v=big.clone())
    headers = {"Content-Type": "application/x-safetensors", "X-API-Key": API_KEY}
    assert_error(
        httpx.post(guarded.url + "/attention", content=body, headers=headers), 413, "payload_too_large"
    )

    def chunks():  # no Content-Length: the limit holds while reading
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)]

    assert_error(httpx.post(guarded.url + "/attention", content=chunks(), headers=headers), 413)
    big_json = b'{"q": [' + b"0.5," * (1 << 21) + b"0.5]}"
    assert_error(
        httpx.post(
            guarded.url + "/attention",
            content=big_json,
            headers={**headers, "Content-Type": "application/json"},
        ),
        413,
    )
    still_serving(guarded.url)


def test_a_413_for_the_declared_length_closes_the_connection(guarded):
    """A body refused for its Content-Length is never read: the answer says Connection: close and
    the server closes (it once kept the connection and read what followed as that body, so the
    next request on it waited --body-timeout-s for a 408)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(guarded.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        sock.sendall(b"POST /attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
                     b"X-API-Key: " + API_KEY.encode() + b"\r\nContent-Length: 99999999\r\n\r\n"
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(1 << 16):  # until the server closes (a timeout fails the test)
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head, data[:300]
    assert data.count(b"HTTP/1.1") == 1, data  # the bytes after the head were not served as a request
    still_serving(guarded.url)


def test_json_limit_413_before_parsing(guarded):
    """A JSON document over --max-json-mb (1 MiB here) is refused although under --max-body-mb (4 MiB):
    parsed JSON numbers take 15-30x their text in memory."""
    json_2mib = b'{"q": [' + b"0.5," * (1 << 19) + b"0.5]}"
    headers = {"Content-Type": "application/json", "X-API-Key": API_KEY}
    r = httpx.post(guarded.url + "/attention", content=json_2mib, headers=headers)
    assert_error(r, 413, "payload_too_large")
    assert "--max-json-mb" in r.json()["error"]["message"] and "safetensors" in r.json()["error"]["message"]
    r = httpx.post(guarded.url + "/v2/models/attention/infer", content=json_2mib, headers=headers)
    assert r.status_code == 413 and "--max-json-mb" in r.json()["error"]
    still_serving(guarded.url)


def _pending(url):
    m = re.search(
        r"^attnserve_inference_pending_requests (\S+)$",
        httpx.get(url + "/metrics", headers={"X-API-Key": API_KEY}).text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def test_queue_full_429(guarded):
    # 2.5 MiB of body for 17 G multiply-adds: seconds on a CPU, so the second request surely finds
    # the queue held even on a loaded machine (the server admits one)
    q = torch.randn(1, 32, 4096, 8, dtype=torch.float16)
    k, v = torch.randn(1, 1, 16384, 8, dtype=torch.float16), torch.randn(1, 1, 16384, 8, dtype=torch.float16)
    headers = {"Content-Type": "application/x-safetensors", "X-API-Key": API_KEY}
    slow_result: dict = {}

    def slow():
        slow_result["r"] = httpx.post(
            guarded.url + "/attention", content=_st(q=q, k=k, v=v), headers=headers, timeout=120
        )

    t = threading.Thread(target=slow)
    t.start()
    deadline = time.monotonic() + 30
    while _pending(guarded.url) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(guarded.url + "/attention", content=_st(q=Q, k=K, v=V), headers=headers)
    t.join()
    assert_error(r, 429, "queue_full")
    assert int(r.headers["retry-after"]) >= 1  # whole seconds; the body holds the estimate itself
    estimate = r.json()["error"]["retry_after_s"]
    assert 0 < estimate <= int(r.headers["retry-after"])
    assert slow_result["r"].status_code == 200
    still_serving(guarded.url)


def test_server_timing_header(http):
    """Each /attention and /layers answer says where the server's time went (W3C Server-Timing):
    read, decode, the engine's queue, launch, device and return, then encode, in that order,
    non-negative, adding up to less than the call."""
    q, k, v = make((1, 2, 2, 16, 16, 8), torch.float32)
    calls = [
        ("/attention", {"q": q, "k": k, "v": v}),
        ("/layers/tiny", {"x": torch.randn(1, 4, 40)}),  # the tiny BERT's hidden size
    ]
    for path, tensors in calls:
        t0 = time.perf_counter()
        r = post_st(http, tensors, path=path)
        wall_ms = 1e3 * (time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        phases = [part.strip().split(";dur=") for part in r.headers["server-timing"].split(",")]
        names = ["read", "decode", "queue", "stage", "launch", "device", "return", "encode"]
        assert [name for name, _ in phases] == names, phases
        durations = [float(d) for _, d in phases]
        assert all(d >= 0 for d in durations) and sum(durations) < wall_ms, (durations, wall_ms)


def test_safetensors_answer_is_sent_from_the_tensors_own_memory():
    """An answer goes out as buffers (header, then each tensor's bytes, views of its memory):
    together they are exactly the safetensors file, empty tensors included; the views do not copy."""
    from service.wire import tensors as wire

    tensors = {
        "o": torch.randn(2, 3, 5, 8).to(torch.bfloat16),
        "lse": torch.randn(2, 3, 5),
        "none": torch.empty(0, 4),
        "strided": torch.randn(4, 6).t(),  # not contiguous: sent as a contiguous copy
    }
    parts = wire.safetensors_parts(tensors)
    assert len(parts) == 4  # the header, o, lse, strided; the empty tensor has no bytes to send
    assert parts[1].obj is not None and torch.frombuffer(parts[1], dtype=torch.bfloat16).data_ptr() == \
        tensors["o"].data_ptr()
    loaded = st.load(b"".join(parts))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_a_body_of_many_chunks_arrives_whole(http):
    """A body read in many pieces (uvicorn hands each gathered piece over: server.py) is put
    together in order: a 12 MiB call sent in uneven chunks gives the reference answer."""
    import uvicorn

    from service.http.uvicorn_patch import UVICORN_HANDING_OVER, hand_over_request_bodies

    assert hand_over_request_bodies() is (uvicorn.__version__ == UVICORN_HANDING_OVER)
    q = torch.randn(1, 2, 64, 32)
    k, v = torch.randn(1, 2, 24576, 32), torch.randn(1, 2, 24576, 32)  # 6 MiB each in float32
    body = st.save({"q": q, "k": k, "v": v})

    def chunks():  # uneven pieces, no Content-Length (chunked transfer encoding)
        pos, step = 0, 1
        while pos < len(body):
            yield body[pos : pos + step]
            pos, step = pos + step, min(step * 3 + 7, 1 << 20)

    r = http.post("/attention", content=chunks(), timeout=120, headers={"content-type": "application/x-safetensors"})
    assert r.status_code == 200, r.text
    o = st.load(r.content)["o"]
    assert torch.allclose(o.double(), attention64(q, k, v)[0], atol=1e-5)
