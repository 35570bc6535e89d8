"""Open Inference Protocol v2 over HTTP (docs/api.md#open-inference-protocol) against a real server,
with Triton's own client (``tritonclient.http``) for JSON and binary tensors, and raw HTTP for what
tritonclient cannot send (BF16 as JSON numbers) and for the error bodies."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as triton
from test_http import assert_matches, make
from tritonclient.utils import InferenceServerException

from tests.conftest import FAST, run_server

NP = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32}
OIP = {torch.float16: "FP16", torch.bfloat16: "BF16", torch.float32: "FP32"}
SHAPE = (2, 4, 2, 17, 23, 40)  # GQA, odd lengths, D = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_bert):
    with run_server(tmp_path_factory.mktemp("oip"), *FAST, "--layer", f"tiny={tiny_bert[0]}:0") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(f"127.0.0.1:{server.http_port}", concurrency=4)
    yield c
    c.close()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def inputs(tensors: dict[str, torch.Tensor], binary: bool) -> list:
    out = []
    for name, t in tensors.items():
        dt = {torch.int32: "INT32", torch.int64: "INT64"}.get(t.dtype) or OIP[t.dtype]
        i = triton.InferInput(name, list(t.shape), dt)
        i.set_data_from_numpy(to_numpy(t), binary_data=binary)
        out.append(i)
    return out


def test_server_and_model_metadata(client, server):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "attnserve" and "binary_tensor_data" in meta["extensions"]
    assert client.is_model_ready("attention") and client.is_model_ready("tiny")
    assert not client.is_model_ready("nope")
    m = client.get_model_metadata("attention")
    assert [i["name"] for i in m["inputs"]] == ["q", "k", "v", "kv_lengths", "alibi_slopes"]
    assert [o["name"] for o in m["outputs"]] == ["o", "lse"]
    m = client.get_model_metadata("tiny")
    assert m["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, -1, 40]}
    config = client.get_model_config("attention")
    assert config["input"][0] == {
        "name": "q",
        "data_type": "TYPE_FP16",
        "dims": [-1, -1, -1, -1],
        "optional": False,
    }
    assert config["output"][1] == {"name": "lse", "data_type": "TYPE_FP32", "dims": [-1, -1, -1]}  # (no "optional")
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope")


# tritonclient sends BF16 only as binary data; test_bf16_json_numbers sends it as JSON numbers
CASES = [
    (torch.float16, True),
    (torch.bfloat16, True),
    (torch.float32, True),
    (torch.float16, False),
    (torch.float32, False),
]


@pytest.mark.parametrize(
    "dtype,binary", CASES, ids=[f"{OIP[d]}-{'binary' if b else 'json'}" for d, b in CASES]
)
def test_attention_tritonclient(client, dtype, binary):
    q, k, v = make(SHAPE, dtype)
    kv_lengths = torch.tensor([23, 0], dtype=torch.int32)  # batch 1 sees no key: o = 0, lse = -inf
    outs = [
        triton.InferRequestedOutput("o", binary_data=binary),
        triton.InferRequestedOutput("lse", binary_data=True),
    ]
    result = client.infer(
        "attention",
        inputs({"q": q, "k": k, "v": v, "kv_lengths": kv_lengths}, binary),
        outputs=outs,
        parameters={"causal": True, "scale": 0.25, "ignored_by_spec": "x"},
    )
    o, lse = from_numpy(result.as_numpy("o")), from_numpy(result.as_numpy("lse"))
    assert result.get_output("o")["datatype"] == OIP[dtype]
    assert torch.all(o[1] == 0) and torch.all(lse[1] == -torch.inf)
    assert_matches(o.to(dtype), q, k, v, lse, causal=True, scale=0.25, kv_lengths=kv_lengths)


def test_parameters_as_strings_and_default_outputs(client):
    q, k, v = make(SHAPE, torch.float16)
    result = client.infer(
        "attention",
        inputs({"q": q, "k": k, "v": v}, True),
        parameters={"causal": "true", "return_lse": "true", "scale": "0.5"},
    )
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["o", "lse"]  # JSON outputs by default, lse because return_lse
    assert_matches(
        from_numpy(result.as_numpy("o")), q, k, v, from_numpy(result.as_numpy("lse")), causal=True, scale=0.5
    )


def test_bf16_json_numbers(server):
    import httpx

    q, k, v = make(SHAPE, torch.bfloat16)
    doc = {
        "id": "r1",
        "inputs": [
            {"name": n, "shape": list(t.shape), "datatype": "BF16", "data": t.float().reshape(-1).tolist()}
            for n, t in (("q", q), ("k", k), ("v", v))
        ],
        "parameters": {"causal": False},
    }
    r = httpx.post(server.url + "/v2/models/attention/infer", content=orjson.dumps(doc))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "r1" and body["model_name"] == "attention"
    [out] = body["outputs"]
    assert out["datatype"] == "BF16" and out["shape"] == list(q.shape)
    assert_matches(torch.tensor(out["data"]).to(torch.bfloat16).reshape(q.shape), q, k, v)


def test_layer_model(client, server):
    import httpx

    x = torch.randn(2, 7, 40)
    via_native = httpx.post(server.url + "/layers/tiny", json={"x": x.tolist()}).json()["y"]
    for binary in (True, False):
        result = client.infer(
            "tiny", inputs({"x": x}, binary), outputs=[triton.InferRequestedOutput("y", binary_data=binary)]
        )
        y = from_numpy(result.as_numpy("y"))
        assert y.shape == x.shape
        assert (y - torch.tensor(via_native)).abs().max() < 1e-5


ERRORS = [
    # (why, model, document or raw body, header length, status)
    (
        "missing input v",
        "attention",
        {"inputs": [{"name": "q", "shape": [1], "datatype": "FP32", "data": [1]}]},
        None,
        400,
    ),
    ("no inputs", "attention", {"id": "x"}, None, 400),
    ("not JSON", "attention", b"{nope", None, 400),
    (
        "unknown datatype",
        "attention",
        {"inputs": [{"name": "q", "shape": [1], "datatype": "FP8", "data": [1]}]},
        None,
        400,
    ),
    (
        "data does not fit the shape",
        "attention",
        {"inputs": [{"name": n, "shape": [1, 1, 2, 4], "datatype": "FP32", "data": [1.0]} for n in "qkv"]},
        None,
        400,
    ),
    (
        "binary size past the body",
        "attention",
        {
            "inputs": [
                {"name": "q", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 400}}
            ]
        },
        "auto",
        400,
    ),
    ("header length past the body", "attention", b"{}", "99", 400),
    (
        "unknown output",
        "attention",
        {
            "inputs": [{"name": n, "shape": [1, 1, 1, 1], "datatype": "FP32", "data": [1.0]} for n in "qkv"],
            "outputs": [{"name": "attn"}],
        },
        None,
        400,
    ),
    (
        "inconsistent shapes",
        "attention",
        {
            "inputs": [{"name": "q", "shape": [1, 1, 1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]
            + [{"name": n, "shape": [1, 1, 1, 1], "datatype": "FP32", "data": [1.0]} for n in "kv"]
        },
        None,
        422,
    ),
    ("unknown model", "nope", {"inputs": []}, None, 404),
    (  # refused, not ignored (as Triton refuses an unexpected input)
        "unknown input",
        "attention",
        {"inputs": [{"name": n, "shape": [1, 1, 1, 1], "datatype": "FP32", "data": [1.0]} for n in "qkvx"]},
        None,
        400,
    ),
    (
        "input given twice",
        "attention",
        {"inputs": [{"name": n, "shape": [1, 1, 1, 1], "datatype": "FP32", "data": [1.0]} for n in "qkvq"]},
        None,
        400,
    ),
    (  # 2**40 must not wrap around to INT32 0 (zeros answered 200)
        "INT32 data out of range",
        "attention",
        {
            "inputs": [{"name": n, "shape": [1, 1, 1, 1], "datatype": "FP32", "data": [1.0]} for n in "qkv"]
            + [{"name": "kv_lengths", "shape": [1], "datatype": "INT32", "data": [2**40]}]
        },
        None,
        400,
    ),
    (
        "layer input of the wrong width",
        "tiny",
        {"inputs": [{"name": "x", "shape": [1, 1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
        None,
        422,
    ),
]


@pytest.mark.parametrize("why,model,doc,header_length,status", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_bodies(server, why, model, doc, header_length, status):
    import httpx

    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    headers = {}
    if header_length == "auto":
        headers["Inference-Header-Content-Length"] = str(len(body))
        body += b"\0" * 8
    elif header_length:
        headers["Inference-Header-Content-Length"] = header_length
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err, str) and err and "Traceback" not in err


def test_tritonclient_sees_the_message(client):
    q = torch.randn(1, 1, 2, 8)
    with pytest.raises(InferenceServerException, match="head dim"):
        client.infer(
            "attention", inputs({"q": q, "k": torch.randn(1, 1, 2, 4), "v": torch.randn(1, 1, 2, 4)}, True)
        )
    assert client.is_server_ready()


def test_binary_data_output_raw(server):
    """The binary extension by hand: binary inputs after the JSON header, binary_data_output."""
    import httpx

    q, k, v = make(SHAPE, torch.float32)
    raw = [t.numpy().tobytes() for t in (q, k, v)]
    doc = {
        "inputs": [
            {
                "name": n,
                "shape": list(t.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(b)},
            }
            for n, t, b in zip("qkv", (q, k, v), raw, strict=True)
        ],
        "parameters": {"binary_data_output": True, "return_lse": True},
    }
    head = orjson.dumps(doc)
    r = httpx.post(
        server.url + "/v2/models/attention/infer",
        content=head + b"".join(raw),
        headers={
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    meta = orjson.loads(r.content[:n])
    sizes = [o["parameters"]["binary_data_size"] for o in meta["outputs"]]
    assert [o["name"] for o in meta["outputs"]] == ["o", "lse"] and n + sum(sizes) == len(r.content)
    o = torch.frombuffer(bytearray(r.content[n : n + sizes[0]]), dtype=torch.float32).reshape(q.shape)
    lse = torch.frombuffer(bytearray(r.content[n + sizes[0] :]), dtype=torch.float32).reshape(q.shape[:3])
    assert_matches(o, q, k, v, lse)


def test_tritonclient_binary_body_over_a_mebibyte(client):
    """A binary infer request of 4 MiB: read straight into one buffer (http_protocol's direct
    read), its JSON part parsed from that buffer and its tensors viewed in it."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 16, 64, generator=g)
    k, v = (torch.randn(1, 4, 2048, 64, generator=g) for _ in range(2))  # 2 MiB each
    result = client.infer("attention", inputs({"q": q, "k": k, "v": v}, True),
                          outputs=[triton.InferRequestedOutput("o", binary_data=True)])
    assert_matches(from_numpy(result.as_numpy("o")), q, k, v)


def test_non_finite_numbers_in_json_as_triton_writes_them(client, server):
    """JSON data carries NaN, Infinity and -Infinity as Triton writes them, both ways: the lse of a
    row that sees no key is -inf (not null, which tritonclient reads as NaN), an inf in v reaches o
    as inf, and tritonclient's own JSON with those names in an input is read. A number past
    float64's range, or past the input's datatype, is still a 400."""
    import json

    import httpx

    q, k, v = make((1, 2, 2, 3, 5, 8), torch.float32)
    v[0, 0, 1, 0] = torch.inf
    q[0, 1, 0, 0] = torch.nan  # its row of o is NaN
    kv_lengths = torch.tensor([5], dtype=torch.int32)
    outs = [triton.InferRequestedOutput("o", binary_data=False), triton.InferRequestedOutput("lse", binary_data=False)]
    got = {}
    for binary in (True, False):  # the same answer over binary data and JSON
        result = client.infer("attention", inputs({"q": q, "k": k, "v": v, "kv_lengths": kv_lengths}, binary),
                              outputs=outs)
        got[binary] = (from_numpy(result.as_numpy("o")), from_numpy(result.as_numpy("lse")))
    assert torch.equal(got[True][0].isnan(), got[False][0].isnan()) and got[False][0].isinf().any()
    assert torch.equal(got[True][0].nan_to_num(), got[False][0].nan_to_num())
    keyless = {"q": q, "k": k, "v": v, "kv_lengths": torch.tensor([0], dtype=torch.int32)}
    none = client.infer("attention", inputs(keyless, True), outputs=outs)
    assert torch.all(from_numpy(none.as_numpy("lse")) == -torch.inf)
    raw = httpx.post(server.url + "/v2/models/attention/infer", content=json.dumps({"inputs": [
        {"name": n, "shape": list(t.shape), "datatype": "FP32", "data": t.reshape(-1).tolist()}
        for n, t in (("q", q), ("k", k), ("v", v))
    ], "parameters": {"return_lse": True}}).replace("Infinity", "1e400"))
    assert raw.status_code == 400 and "past float64's range" in raw.json()["error"], raw.text
    big = json.dumps({"inputs": [
        {"name": n, "shape": list(t.shape), "datatype": "FP16", "data": [1e6] + t.reshape(-1).tolist()[1:]}
        for n, t in (("q", q), ("k", k), ("v", v))]})
    raw = httpx.post(server.url + "/v2/models/attention/infer", content=big)
    assert raw.status_code == 400 and "past the range of float16" in raw.json()["error"], raw.text
