"""Hostile inputs on every transport, against one real CPU server: shapes that overflow int64
once their zero dim is ignored, safetensors headers whose data_offsets overlap, leave gaps or run
past the data, names given twice, JSON booleans (strings, null, objects) where numbers belong; and
structured fuzzing (hypothesis) of the safetensors header, the JSON tensors, the OIP binary framing
and the gRPC messages. Every answer is a 4xx / INVALID_ARGUMENT-like status (docs/api.md#errors), never a
5xx, INTERNAL or UNKNOWN, and the server keeps serving.

The OIP gRPC messages are tritonclient's own (``service.grpc.oip`` must not be imported in a
process that imports ``tritonclient.grpc``: see ``service.grpc.protogen``).
"""

from __future__ import annotations

import base64
import struct

import grpc
import httpx
import orjson
import pytest
import torch
from conftest import run_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc

from service.grpc.protogen import attention_stubs

apb = attention_stubs().attention_pb2
apb_grpc = attention_stubs().attention_pb2_grpc

ST = "application/x-safetensors"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HTTP_REFUSALS = {400, 413, 415, 422}
GRPC_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}
# a zero dim, the others overflowing int64 (or 2**40 elements) once it is left out
OVERFLOWING = [[2**63 - 1, 0, 1, 1], [2**62, 4, 0, 1], [2**31, 0, 1, 1], [2**20, 2**20, 0, 2]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("hostile-wire"), "--warmup-shapes", "1x1x16x16",
                    "--warmup-dtypes", "float32", "--max-body-mb", "8") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def native(channel):
    return apb_grpc.AttentionServiceStub(channel)


@pytest.fixture(scope="module")
def oip(channel):
    return tpb_grpc.GRPCInferenceServiceStub(channel)


def qkv(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(1, 2, 3, 4, generator=g) for n in "qkv"}


def expected(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"])


def safetensors_file(header: dict | str, data: bytes = b"") -> bytes:
    head = header if isinstance(header, str) else orjson.dumps(header).decode()
    raw = head.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def good_safetensors(t: dict[str, torch.Tensor]) -> bytes:
    header, data = {}, b""
    for name, x in t.items():
        b = x.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(x.shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    return safetensors_file(header, data)


def assert_serving(http, native) -> None:
    """A good request still answers right, over HTTP and gRPC."""
    t = qkv(7)
    r = http.post("/attention", json={n: x.tolist() for n, x in t.items()})
    assert r.status_code == 200, r.text
    assert torch.allclose(torch.tensor(r.json()["o"]), expected(t), atol=1e-5)
    resp = native.Attend(apb.AttendRequest(**{n: grpc_tensor(x) for n, x in t.items()}), timeout=30)
    o = torch.frombuffer(bytearray(resp.o.data), dtype=torch.float32).view(list(resp.o.shape))
    assert torch.allclose(o, expected(t), atol=1e-5)


def grpc_tensor(x: torch.Tensor):
    return apb.Tensor(shape=list(x.shape), dtype=apb.FLOAT32, data=x.numpy().tobytes())


def assert_refused(r: httpx.Response, statuses=HTTP_REFUSALS) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text)
    body = r.json()
    if r.request.url.path.startswith("/v2"):
        assert isinstance(body["error"], str)
    else:
        assert set(body["error"]) == {"code", "message"}
    return body


def message(body: dict) -> str:
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


def grpc_status(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        call(*args, timeout=30, **kwargs)
    except grpc.RpcError as exc:
        assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc.details()
        return exc.code()
    return grpc.StatusCode.OK


# ---------------------------------------------------------------- 1. shapes that overflow


@pytest.mark.parametrize("shape", OVERFLOWING, ids=str)
def test_overflowing_empty_shapes_are_refused_on_every_transport(http, native, oip, shape):
    one = qkv()
    small = {"shape": [1, 2, 3, 4], "data": one["k"].reshape(-1).tolist()}
    entry = {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
    k = one["k"].numpy().tobytes()
    header = {"q": entry, "k": {"dtype": "F32", "shape": [1, 2, 3, 4], "data_offsets": [0, len(k)]},
              "v": {"dtype": "F32", "shape": [1, 2, 3, 4], "data_offsets": [len(k), 2 * len(k)]}}
    answers = [
        http.post("/attention", content=safetensors_file(header, k + k), headers={"content-type": ST}),
        http.post("/attention", json={"q": {"shape": shape, "data": []}, "k": small, "v": small}),
        http.post("/attention", json={"q": {"shape": shape, "dtype": "float16", "data": ""}, "k": small, "v": small}),
        http.post("/layers/none", json={"x": {"shape": shape[:3], "data": []}}),
    ]
    inputs = [{"name": "q", "shape": shape, "datatype": "FP32", "data": []},
              *({"name": n, "shape": [1, 2, 3, 4], "datatype": "FP32", "data": small["data"]} for n in "kv")]
    answers.append(http.post("/v2/models/attention/infer", json={"inputs": inputs}))
    head = orjson.dumps({"inputs": [{"name": "q", "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": 0}}, *inputs[1:]]})
    answers.append(http.post("/v2/models/attention/infer", content=head,
                             headers={"Inference-Header-Content-Length": str(len(head))}))
    for r in answers:
        if r.request.url.path == "/layers/none" and r.status_code == 404:
            continue  # no layer loaded: the shape may be checked first or not; never a 5xx
        body = assert_refused(r, {422})
        assert "shape" in message(body) and str(shape[0]) in message(body)

    bad = apb.Tensor(shape=shape, dtype=apb.FLOAT32, data=b"")
    assert grpc_status(native.Attend, apb.AttendRequest(q=bad, k=grpc_tensor(one["k"]), v=grpc_tensor(one["v"]))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    for raw in (True, False):
        req = tpb.ModelInferRequest(model_name="attention")
        for n in "qkv":
            inp = req.inputs.add(name=n, datatype="FP32", shape=shape if n == "q" else [1, 2, 3, 4])
            data = b"" if n == "q" else one[n].numpy().tobytes()
            if raw:
                req.raw_input_contents.append(data)
            else:
                inp.contents.fp32_contents.extend([] if n == "q" else one[n].reshape(-1).tolist())
        assert grpc_status(oip.ModelInfer, req) == grpc.StatusCode.INVALID_ARGUMENT
    assert_serving(http, native)


# ---------------------------------------------------------------- non-finite inputs

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_non_finite_inputs_get_the_same_nan_rows_on_every_transport(http, native, oip, dtype):
    """+inf in one element of q (row 1) and NaN in one of k (head 1): the rows that meet them are
    NaN in o, every other row is the right answer, bit for bit the same over safetensors, JSON
    base64, native gRPC and OIP gRPC (docs/api.md, "Inputs")."""
    from safetensors.torch import load, save

    g = torch.Generator().manual_seed(3)
    t = {n: torch.randn(1, 2, 3, 8, generator=g).to(dtype) for n in "qkv"}
    t["q"][0, 0, 1, 2] = float("inf")
    t["k"][0, 1, 0, 5] = float("nan")
    answers = []
    r = http.post("/attention", content=save(t), headers={"content-type": ST})
    assert r.status_code == 200, r.text
    answers.append(load(r.content)["o"])
    name = {torch.float16: "float16", torch.float32: "float32"}[dtype]
    doc = {n: {"shape": list(x.shape), "dtype": name, "data": base64.b64encode(x.numpy().tobytes()).decode()}
           for n, x in t.items()}
    r = http.post("/attention", json=doc)
    assert r.status_code == 200, r.text
    o = r.json()["o"]
    answers.append(torch.frombuffer(bytearray(base64.b64decode(o["data"])), dtype=dtype).view(o["shape"]))
    code = {torch.float16: apb.FLOAT16, torch.float32: apb.FLOAT32}[dtype]
    resp = native.Attend(apb.AttendRequest(**{n: apb.Tensor(shape=list(x.shape), dtype=code,
                                                              data=x.numpy().tobytes())
                                              for n, x in t.items()}), timeout=30)
    answers.append(torch.frombuffer(bytearray(resp.o.data), dtype=dtype).view(list(resp.o.shape)))
    req = tpb.ModelInferRequest(model_name="attention")
    for n, x in t.items():
        req.inputs.add(name=n, datatype={torch.float16: "FP16", torch.float32: "FP32"}[dtype], shape=list(x.shape))
        req.raw_input_contents.append(x.numpy().tobytes())
    out = oip.ModelInfer(req, timeout=30)
    answers.append(torch.frombuffer(bytearray(out.raw_output_contents[0]), dtype=dtype).view(list(t["q"].shape)))
    first = answers[0].nan_to_num(0.0)
    for i, a in enumerate(answers[1:]):  # a NaN's sign bit means nothing: NaN where the first has NaN
        assert torch.equal(a.isnan(), answers[0].isnan())
        assert torch.equal(a.nan_to_num(0.0), first), (i, (a.nan_to_num(0.0) - first).abs().max())
    o = answers[0]
    bad = torch.zeros(1, 2, 3, dtype=torch.bool)
    bad[0, 0, 1] = True      # q's +inf row
    bad[0, 1, :] = True      # every row of head 1 sees k's NaN
    assert o[bad].isnan().all() and torch.isfinite(o[~bad]).all()
    want = torch.nn.functional.scaled_dot_product_attention(t["q"].double(), t["k"].double(), t["v"].double())
    assert (o[~bad].double() - want[~bad]).abs().max() < 2e-3
    assert_serving(http, native)


# ---------------------------------------------------------------- 2. safetensors data_offsets, names


def _entry(offsets, shape=(1, 2, 3, 4)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": list(offsets)}


N = 96  # bytes of one [1, 2, 3, 4] float32 tensor

SAFETENSORS_CASES = {
    "overlap": ({"q": _entry([0, N]), "k": _entry([N // 2, N // 2 + N]), "v": _entry([2 * N, 3 * N])}, 3 * N, "'k'"),
    "alias": ({"q": _entry([0, N]), "k": _entry([0, N]), "v": _entry([N, 2 * N])}, 2 * N, "overlap"),
    "gap": ({"q": _entry([0, N]), "k": _entry([N + 8, 2 * N + 8]), "v": _entry([2 * N + 8, 3 * N + 8])},
            3 * N + 8, "'k'"),
    "gap at the start": ({"q": _entry([8, N + 8]), "k": _entry([N + 8, 2 * N + 8]),
                          "v": _entry([2 * N + 8, 3 * N + 8])}, 3 * N + 8, "'q'"),
    "past the end": ({"q": _entry([0, N]), "k": _entry([N, 2 * N]), "v": _entry([2 * N, 3 * N])}, 3 * N - 4, "'v'"),
    "bytes left over": ({"q": _entry([0, N]), "k": _entry([N, 2 * N]), "v": _entry([2 * N, 3 * N])}, 3 * N + 4,
                        "4 bytes"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_safetensors_offsets_must_tile_the_data(http, native, case):
    header, size, named = SAFETENSORS_CASES[case]
    r = http.post("/attention", content=safetensors_file(header, bytes(size)), headers={"content-type": ST})
    body = assert_refused(r, {400})
    assert named in message(body), message(body)


@pytest.mark.parametrize("twice", ["k", "dtype"])
def test_safetensors_names_given_twice_are_refused(http, native, twice):
    t = qkv()
    data = b"".join(t[n].numpy().tobytes() for n in "qkv")
    q, k, v = (orjson.dumps(_entry([i * N, (i + 1) * N])).decode() for i in range(3))
    if twice == "k":
        head = f'{{"q":{q},"k":{k},"k":{k},"v":{v}}}'
    else:
        head = f'{{"q":{q[:-1]},"dtype":"F16"}},"k":{k},"v":{v}}}'
    r = http.post("/attention", content=safetensors_file(head, data), headers={"content-type": ST})
    body = assert_refused(r, {400})
    assert f"'{twice}' twice" in message(body)
    assert_serving(http, native)


def test_a_file_the_safetensors_library_writes_is_served(http):
    from safetensors.torch import save

    t = qkv(3)
    r = http.post("/attention", content=save(t, metadata={"causal": "true"}), headers={"content-type": ST})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- score modifiers, hostile values

HOSTILE_WINDOWS = [[2**62, 0], [-2**62, 0], [2**63 - 1, 2**63 - 1], [1, 2, 3], [0]]
HOSTILE_CAPS = [float("nan"), float("-inf"), float("inf"), -1e-300, 1e308]


def test_hostile_window_softcap_and_slopes_are_refused_or_served_on_every_transport(http, native, oip):
    """Windows and caps at the ends of their types, slopes of every wrong dtype and shape (an
    overflowing one included): a 4xx / INVALID_ARGUMENT naming the option, or (a huge window or
    cap, which bounds nothing) an answer; never a server error."""
    t = qkv()
    msg = {n: grpc_tensor(x) for n, x in t.items()}
    for w in HOSTILE_WINDOWS:
        ok = len(w) == 2 and min(w) >= -1
        r = http.post("/attention", params={"window_size": ",".join(map(str, w))},
                      json={n: x.tolist() for n, x in t.items()})
        if ok:
            assert r.status_code == 200, r.text
        else:
            assert "window_size" in message(assert_refused(r, {400}))
        code = grpc_status(native.Attend, apb.AttendRequest(**msg, window_size=w))
        assert code == (grpc.StatusCode.OK if ok else grpc.StatusCode.INVALID_ARGUMENT), w
    for cap in HOSTILE_CAPS:
        ok = cap == 1e308
        r = http.post("/attention", json={**{n: x.tolist() for n, x in t.items()}, "softcap": repr(cap)})
        if ok:
            assert r.status_code == 200, r.text
        else:
            assert "softcap" in message(assert_refused(r, {400}))
        code = grpc_status(native.Attend, apb.AttendRequest(**msg, softcap=cap))
        assert code == (grpc.StatusCode.OK if ok else grpc.StatusCode.INVALID_ARGUMENT), cap
        params = {"softcap": tpb.InferParameter(double_param=cap)}
        inputs = [tpb.ModelInferRequest.InferInputTensor(name=n, datatype="FP32", shape=list(x.shape))
                  for n, x in t.items()]
        raw = [x.numpy().tobytes() for x in t.values()]
        code = grpc_status(oip.ModelInfer, tpb.ModelInferRequest(model_name="attention", inputs=inputs,
                                                                  raw_input_contents=raw, parameters=params))
        assert code == (grpc.StatusCode.OK if ok else grpc.StatusCode.INVALID_ARGUMENT), cap
    bad_slopes = [
        apb.Tensor(shape=[2], dtype=apb.INT64, data=b"\0" * 16),  # not float32
        apb.Tensor(shape=[2], dtype=apb.FLOAT16, data=b"\0" * 4),
        apb.Tensor(shape=[3], dtype=apb.FLOAT32, data=b"\0" * 12),  # Hq is 2
        apb.Tensor(shape=[1, 1, 2], dtype=apb.FLOAT32, data=b"\0" * 8),
        apb.Tensor(shape=[2**62, 4, 0], dtype=apb.FLOAT32, data=b""),  # overflows once the 0 is left out
        apb.Tensor(shape=[2], dtype=apb.FLOAT32, data=b"\0" * 7),  # bytes that do not fit the shape
    ]
    for slopes in bad_slopes:
        assert grpc_status(native.Attend, apb.AttendRequest(**msg, alibi_slopes=slopes)) in GRPC_REFUSALS
    for doc in ({"alibi_slopes": [[0.5, "x"]]}, {"alibi_slopes": [0.5]}, {"alibi_slopes": True},
                {"alibi_slopes": {"shape": [2], "dtype": "int32", "data": [1, 2]}}):
        r = http.post("/attention", json={**{n: x.tolist() for n, x in t.items()}, **doc})
        assert "alibi_slopes" in message(assert_refused(r, {400, 422})), doc
    assert_serving(http, native)


def test_options_past_what_the_kernels_hold_are_400s_like_other_bad_values(http, native):
    """A scale past float32's range over log2(e) and a softcap under float32's smallest normal are
    bad option values, a 400 naming the option as the other bad values are (the kernels' own checks
    answered them with 422); in a query string given twice, an option is a 400 too."""
    doc = {n: x.tolist() for n, x in qkv().items()}
    for params, name in (({"scale": "2.4e38"}, "scale"), ({"softcap": "1e-39"}, "softcap"),
                         ([("causal", "true"), ("causal", "false")], "causal")):
        r = http.post("/attention", params=params, json=doc)
        assert f"'{name}'" in message(assert_refused(r, {400})), params
    r = http.post("/attention", params={"scale": "2.3e38"}, json=doc)
    assert r.status_code == 200, r.text
    assert_serving(http, native)


# ---------------------------------------------------------------- 3. numbers only in JSON tensors

BAD_LEAVES = [True, False, None, "1.0", {"a": 1}]


@pytest.mark.parametrize("leaf", BAD_LEAVES, ids=repr)
def test_json_tensors_hold_numbers_only(http, native, leaf):
    t = qkv()
    nested = t["q"].tolist()
    nested[0][1][2][3] = leaf
    flat = t["q"].reshape(-1).tolist()
    flat[5] = leaf
    good = {n: t[n].tolist() for n in "kv"}
    cases = [
        ("/attention", {"q": nested, **good}, "q[0][1][2][3]"),
        ("/attention", {"q": {"shape": [1, 2, 3, 4], "data": flat}, **good}, "q[5]"),
        ("/attention", {**{n: t[n].tolist() for n in "qkv"}, "kv_lengths": [leaf]}, "kv_lengths[0]"),
    ]
    for path, doc, where in cases:
        body = assert_refused(http.post(path, json=doc), {400})
        assert where in message(body), message(body)
    inputs = [{"name": n, "shape": [1, 2, 3, 4], "datatype": "FP32", "data": t[n].reshape(-1).tolist()} for n in "kv"]
    for data, where in ((flat, "data[5]"), (nested, "data[0][1][2][3]")):
        doc = {"inputs": [{"name": "q", "shape": [1, 2, 3, 4], "datatype": "FP32", "data": data}, *inputs]}
        body = assert_refused(http.post("/v2/models/attention/infer", json=doc), {400})
        assert where in message(body), message(body)
    assert_serving(http, native)


# ---------------------------------------------------------------- fuzzing: safetensors headers

NAMES = ["q", "k", "v", "kv_lengths", "x", ""]
ST_SIZES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}
DIMS = st.one_of(st.integers(0, 5), st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1, -1]))
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3), st.just([1.5]), st.just({}))


HUGE = st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1])
EMPTY_HUGE = st.tuples(st.lists(st.one_of(st.integers(1, 4), HUGE), min_size=1, max_size=4), st.integers(0, 4)).map(
    lambda t: t[0][: t[1]] + [0] + t[0][t[1]:])  # a zero dim among others that overflow once it is left out


@st.composite
def mutated_safetensors(draw) -> tuple[bytes, bool]:
    """A good q, k, v file (tensors in any order), or that file with one thing wrong: two entries
    sharing bytes, a gap, a name twice, bytes left over or missing, an empty shape that overflows."""
    t = qkv(draw(st.integers(0, 3)))
    order = draw(st.permutations("qkv"))
    entries, data = [], b""
    for n in order:
        b = t[n].numpy().tobytes()
        entries.append([n, {"dtype": "F32", "shape": [1, 2, 3, 4], "data_offsets": [len(data), len(data) + len(b)]}])
        data += b
    mutation = draw(st.sampled_from(["none", "overlap", "gap", "twice", "more", "less", "empty huge"]))
    i = draw(st.integers(0, 2))
    if mutation == "overlap":
        entries[i][1]["data_offsets"] = list(entries[(i + 1) % 3][1]["data_offsets"])
    elif mutation == "gap":
        for e in entries[i:]:
            e[1]["data_offsets"] = [o + 4 for o in e[1]["data_offsets"]]
        data = data + bytes(4)
    elif mutation == "twice":
        entries.insert(draw(st.integers(0, 3)), [entries[i][0], dict(entries[i][1])])
    elif mutation == "more":
        data += bytes(draw(st.integers(1, 8)))
    elif mutation == "less":
        data = data[: -draw(st.integers(1, 8))]
    elif mutation == "empty huge":
        begin = entries[i][1]["data_offsets"][0]
        entries[i][1] = {"dtype": "F32", "shape": draw(EMPTY_HUGE), "data_offsets": [begin, begin]}
        for e in entries[i + 1:]:
            e[1]["data_offsets"] = [o - 96 for o in e[1]["data_offsets"]]
        data = data[:-96]
    head = "{" + ",".join(f"{orjson.dumps(k).decode()}:{orjson.dumps(v).decode()}" for k, v in entries) + "}"
    return safetensors_file(head, data), mutation == "none"


@FUZZ
@given(case=mutated_safetensors())
def test_fuzz_mutated_safetensors(http, case):
    body, good = case
    r = http.post("/attention", content=body, headers={"content-type": ST})
    if good:
        assert r.status_code == 200, r.text
    else:
        assert_refused(r)


@st.composite
def safetensors_bodies(draw) -> tuple[bytes, bool]:
    """(a safetensors body, whether the safetensors library reads it): tensors tiled right or
    with their offsets nudged, dtypes and shapes right or wrong, names repeated, metadata values
    of any JSON type."""
    entries, at = [], 0
    for name in draw(st.lists(st.sampled_from(NAMES), max_size=5)):
        dtype = draw(st.one_of(st.sampled_from(list(ST_SIZES)), JUNK))
        shape = draw(st.one_of(st.lists(DIMS, max_size=5), JUNK))
        numel = 1
        for d in shape if isinstance(shape, list) and all(type(d) is int and 0 <= d < 64 for d in shape) else [0]:
            numel *= d
        n = numel * ST_SIZES.get(dtype, 1) if isinstance(dtype, str) else 0
        begin, end = at, at + n
        nudge = draw(st.sampled_from([None, None, None, "begin", "end", "junk"]))
        if nudge == "begin":
            begin += draw(st.integers(-8, 8))
        elif nudge == "end":
            end += draw(st.integers(-8, 8))
        offsets = draw(JUNK) if nudge == "junk" else [begin, end]
        entries.append((name, {"dtype": dtype, "shape": shape, "data_offsets": offsets}))
        at = max(at, end)
    if draw(st.booleans()):
        meta = draw(st.dictionaries(st.sampled_from(["causal", "scale", "format", "casual"]),
                                    st.one_of(st.sampled_from(["true", "0.5", "pt", "x"]), JUNK), max_size=3))
        entries.insert(draw(st.integers(0, len(entries))), ("__metadata__", meta))
    head = "{" + ",".join(f"{orjson.dumps(k).decode()}:{orjson.dumps(v).decode()}" for k, v in entries) + "}"
    data = bytes(max(0, at + draw(st.sampled_from([0, 0, 0, -4, 4]))))
    body = safetensors_file(head, data)
    if draw(st.integers(0, 9)) == 0:  # a broken length prefix
        body = struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + body[8:]
    try:
        from safetensors.torch import load

        load(body)
        readable = True
    except Exception:  # noqa: BLE001 - SafetensorsError, or whatever the format refuses
        readable = False
    return body, readable


@FUZZ
@given(case=safetensors_bodies())
def test_fuzz_safetensors_headers(http, case):
    body, readable = case
    r = http.post("/attention", content=body, headers={"content-type": ST})
    if r.status_code != 200:
        assert_refused(r)
    else:
        assert readable, "the server computed a file the safetensors format refuses"


def test_fuzzed_safetensors_leave_the_server_serving(http, native):
    assert_serving(http, native)


# ---------------------------------------------------------------- fuzzing: JSON tensors

LEAVES = st.one_of(st.floats(-4, 4, width=32), st.integers(-3, 3), st.booleans(), st.none(),
                   st.text(max_size=2), st.just({"x": 1}), st.just([]))
NUMBERS = st.one_of(st.floats(-4, 4, width=32), st.integers(-3, 3))


def _bad(value) -> bool:
    """Whether a nested list holds a leaf that is not a number."""
    if isinstance(value, list):
        return any(_bad(v) for v in value)
    return isinstance(value, bool) or not isinstance(value, int | float)


@st.composite
def json_tensors(draw):
    kind = draw(st.sampled_from(["good", "nested", "ragged", "flat", "base64", "junk"]))
    if kind == "good":
        return torch.randn(1, 2, 3, 4).tolist()
    if kind in ("nested", "ragged"):
        leaf = LEAVES if draw(st.booleans()) else NUMBERS
        inner = st.lists(leaf, min_size=1, max_size=4)
        if kind == "ragged":
            inner = st.lists(st.one_of(leaf, inner), min_size=1, max_size=3)
        return draw(st.lists(st.lists(st.lists(inner, min_size=1, max_size=2), min_size=1, max_size=2),
                             min_size=1, max_size=2))
    shape = draw(st.one_of(st.lists(DIMS, max_size=5), st.just([1, 2, 3, 4]), EMPTY_HUGE, JUNK))
    dtype = draw(st.one_of(st.sampled_from(["float16", "bfloat16", "float32", "int32", "int64", "float64"]),
                           st.none(), JUNK))
    if kind == "flat":
        data = draw(st.one_of(st.lists(LEAVES, max_size=30), st.just(torch.randn(24).tolist())))
    elif kind == "base64":
        data = base64.b64encode(draw(st.binary(max_size=100))).decode() + draw(st.sampled_from(["", "", "!"]))
    else:
        data = draw(JUNK)
    obj = {"shape": shape, "data": data}
    if dtype is not None:
        obj["dtype"] = dtype
    return obj


@st.composite
def json_with_a_bad_leaf(draw):
    """Good q, k, v in some encoding, one leaf of one of them (or of kv_lengths) not a number; or an
    empty typed tensor whose other dims overflow."""
    t = qkv(draw(st.integers(0, 3)))
    doc = {n: t[n].tolist() for n in "qkv"}
    name = draw(st.sampled_from(["q", "k", "v", "kv_lengths"]))
    leaf = draw(st.sampled_from(BAD_LEAVES))
    if name == "kv_lengths":
        doc["kv_lengths"] = [leaf]
    elif draw(st.booleans()):
        flat = t[name].reshape(-1).tolist()
        flat[draw(st.integers(0, 23))] = leaf
        doc[name] = {"shape": [1, 2, 3, 4], "data": flat}
        if draw(st.booleans()):  # an empty tensor whose other dims overflow
            doc[name] = {"shape": draw(EMPTY_HUGE), "data": draw(st.sampled_from([[], ""]))}
    else:
        nested = doc[name]
        a, b, c, d = (draw(st.integers(0, n - 1)) for n in (1, 2, 3, 4))
        nested[a][b][c][d] = leaf
    return doc


@FUZZ
@given(doc=json_with_a_bad_leaf())
def test_fuzz_json_with_a_bad_leaf(http, doc):
    assert_refused(http.post("/attention", content=orjson.dumps(doc), headers={"content-type": "application/json"}),
                   {400, 422})


@FUZZ
@given(q=json_tensors(), k=json_tensors(), v=json_tensors())
def test_fuzz_json_tensors(http, q, k, v):
    r = http.post("/attention", content=orjson.dumps({"q": q, "k": k, "v": v}),
                  headers={"content-type": "application/json"})
    if r.status_code != 200:
        assert_refused(r)
    else:
        for t in (q, k, v):
            data = t.get("data") if isinstance(t, dict) else t
            assert not (isinstance(data, list) and _bad(data)), "a non-number was computed as a number"


# ---------------------------------------------------------------- fuzzing: OIP binary framing


@st.composite
def oip_binary(draw):
    t = qkv()
    blobs = {n: t[n].numpy().tobytes() for n in "qkv"}
    inputs, data = [], b""
    for n in draw(st.permutations("qkv")):
        size = len(blobs[n])
        claim = draw(st.one_of(st.just(size), st.just(size), st.integers(-2, size + 8), JUNK))
        shape = draw(st.one_of(st.just([1, 2, 3, 4]), st.lists(DIMS, max_size=5), EMPTY_HUGE))
        datatype = draw(st.sampled_from(["FP32", "FP32", "FP16", "INT64", "BYTES", "fp32"]))
        inputs.append({"name": n, "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": claim}})
        data += blobs[n][: draw(st.sampled_from([size, size, size, size // 2]))]
    outputs = draw(st.sampled_from([None, [{"name": "o", "parameters": {"binary_data": True}}], [{"name": "z"}]]))
    doc = {"inputs": inputs} if outputs is None else {"inputs": inputs, "outputs": outputs}
    head = orjson.dumps(doc)
    data += bytes(draw(st.sampled_from([0, 0, 0, 3])))
    length = draw(st.one_of(st.just(str(len(head))), st.just(str(len(head))),
                            st.integers(-5, len(head) + len(data) + 5).map(str), st.sampled_from(["", "x", "1e3"])))
    return head + data, length


@FUZZ
@given(case=oip_binary())
def test_fuzz_oip_binary_framing(http, case):
    body, length = case
    r = http.post("/v2/models/attention/infer", content=body,
                  headers={"Inference-Header-Content-Length": length, "content-type": "application/octet-stream"})
    if r.status_code != 200:
        assert_refused(r)


def test_fuzzed_framing_leaves_the_server_serving(http, native):
    assert_serving(http, native)


# ---------------------------------------------------------------- fuzzing: gRPC messages

GRPC_DIMS = st.one_of(st.integers(0, 5), st.sampled_from([-1, -(2**63), 2**31, 2**62, 2**63 - 1]))
GRPC_SHAPES = st.one_of(st.just([1, 2, 3, 4]), st.lists(GRPC_DIMS, max_size=10), EMPTY_HUGE)


@st.composite
def grpc_tensors(draw):
    shape = draw(GRPC_SHAPES)
    dtype = draw(st.one_of(st.just(3), st.integers(0, 7)))
    n = 96 if draw(st.booleans()) else draw(st.integers(0, 200))
    return apb.Tensor(shape=shape, dtype=dtype, data=bytes(n))


@FUZZ
@given(q=grpc_tensors(), k=grpc_tensors(), v=grpc_tensors(), layout=st.sampled_from(["", "bnhd", "nope"]),
       lengths=st.one_of(st.none(), grpc_tensors()))
def test_fuzz_native_grpc_tensors(native, q, k, v, layout, lengths):
    msg = apb.AttendRequest(q=q, k=k, v=v, layout=layout)
    if lengths is not None:
        msg.kv_lengths.CopyFrom(lengths)
    assert grpc_status(native.Attend, msg) in GRPC_REFUSALS | {grpc.StatusCode.OK}


@st.composite
def oip_requests(draw):
    req = tpb.ModelInferRequest(model_name=draw(st.sampled_from(["attention", "attention", "nope"])))
    raw = draw(st.booleans())
    for n in draw(st.lists(st.sampled_from(["q", "k", "v", "kv_lengths", "x"]), max_size=4)):
        shape = draw(GRPC_SHAPES)
        datatype = draw(st.sampled_from(["FP32", "FP16", "BF16", "INT32", "INT64", "FP64", "BOOL", "", "x"]))
        inp = req.inputs.add(name=n, datatype=datatype, shape=shape)
        count = 24 if draw(st.booleans()) else draw(st.integers(0, 40))
        if raw:
            req.raw_input_contents.append(bytes(count * draw(st.sampled_from([1, 2, 4, 8]))))
        else:
            inp.contents.fp32_contents.extend([0.5] * count)
            inp.contents.int64_contents.extend([1] * draw(st.integers(0, 2)))
    if raw and draw(st.integers(0, 4)) == 0:
        req.raw_input_contents.append(b"extra")
    return req


@FUZZ
@given(req=oip_requests())
def test_fuzz_oip_grpc_requests(oip, req):
    assert grpc_status(oip.ModelInfer, req) in GRPC_REFUSALS | {grpc.StatusCode.OK}


def test_fuzzed_grpc_leaves_the_server_serving(http, native):
    assert_serving(http, native)


# ---------------------------------------------------------------- fuzzing: the session routes and rpcs

SESSION = {"layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32"}  # qkv()'s k, v: [1, 2, 3, 4]
OPTION_JUNK = st.one_of(st.none(), st.sampled_from(["0", "1", "2", "-1", "x", "true", "nan", "1e9", "", "bnhd"]))


def _lengths(http, sid: str) -> list[int]:
    r = http.get(f"/sessions/{sid}")
    assert r.status_code == 200, r.text
    return r.json()["lengths"]


@pytest.fixture(scope="module")
def session(http):
    r = http.post("/sessions", json={**SESSION, "session": "fuzzed"})
    assert r.status_code == 201, r.text
    yield "fuzzed"
    http.delete("/sessions/fuzzed")


@FUZZ
@given(case=mutated_safetensors(), layer=OPTION_JUNK, causal=OPTION_JUNK, scale=OPTION_JUNK,
       layout=OPTION_JUNK, packed=st.booleans(), q_lengths=st.sampled_from([[3], [2], [3, 0], [-1], [4]]))
def test_fuzz_session_steps_append_nothing_unless_answered(http, session, case, layer, causal, scale, layout,
                                                           packed, q_lengths):
    """Steps with mutated safetensors bodies and junk options, single or packed: a 200 or a clear
    refusal, and the session grows by a step's rows exactly when it was answered."""
    body, _ = case
    params = {k: v for k, v in {"layer": layer, "causal": causal, "scale": scale, "layout": layout}.items()
              if v is not None}
    before = _lengths(http, session)
    if packed:  # the file's q, k, v are [1, 2, 3, 4]: a packed step wants them 3-D, so most are refused
        params["sessions"] = session
        head, data = body[: 8 + int.from_bytes(body[:8], "little")], body[8 + int.from_bytes(body[:8], "little"):]
        r = http.post("/sessions/attend", params={**params, "q_lengths": ",".join(map(str, q_lengths))},
                      content=head + data, headers={"content-type": ST})
    else:
        r = http.post(f"/sessions/{session}/attend", params=params, content=body, headers={"content-type": ST})
    after = _lengths(http, session)
    if r.status_code == 200:
        grown = [a - b for a, b in zip(after, before, strict=True)]
        assert sorted(grown) in ([0, 0], [0, 3]), (grown, r.headers)
    else:
        assert_refused(r, HTTP_REFUSALS | {404, 507})
        assert after == before, "a refused step appended keys"


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(["layers", "num_kv_heads", "head_dim", "dtype", "session", "x"]),
                           st.one_of(JUNK, st.integers(-2, 300), st.sampled_from(["float16", "bfloat16", "int8",
                                                                                   "a/b", "attend", "." * 3])),
                           max_size=6))
def test_fuzz_session_creates(http, doc):
    """POST /sessions with any JSON object: 201 (then it is deleted) or a clear refusal."""
    r = http.post("/sessions", json=doc)
    if r.status_code == 201:
        assert http.delete(f"/sessions/{r.json()['session']}").status_code == 204
    else:
        assert_refused(r, HTTP_REFUSALS | {409, 507})


@FUZZ
@given(q=grpc_tensors(), k=grpc_tensors(), v=grpc_tensors(), lengths=st.one_of(st.none(), grpc_tensors()),
       layer=st.integers(-2, 3), layout=st.sampled_from(["", "bnhd", "nope"]), many=st.booleans())
def test_fuzz_session_attend_rpc(http, native, session, q, k, v, lengths, layer, layout, many):
    before = _lengths(http, session)
    msg = apb.SessionAttendRequest(sessions=[session] * (2 if many else 1), q=q, k=k, v=v, layer=layer,
                                   layout=layout)
    if lengths is not None:
        msg.q_lengths.CopyFrom(lengths)
    status = grpc_status(native.SessionAttend, msg)
    assert status in GRPC_REFUSALS | {grpc.StatusCode.OK}
    if status != grpc.StatusCode.OK:
        assert _lengths(http, session) == before


def test_fuzzed_sessions_leave_the_server_serving(http, native):
    assert_serving(http, native)


@FUZZ
@given(layers=st.integers(-1, 5), heads=st.integers(-1, 300), head_dim=st.integers(-1, 300),
       dtype=st.integers(0, 8), name=st.one_of(st.just(""), st.text(max_size=140)))
def test_fuzz_create_session_rpc(http, native, layers, heads, head_dim, dtype, name):
    """CreateSession with any field values: OK (then deleted) or a clear refusal."""
    msg = apb.CreateSessionRequest(session=name, layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    try:
        info = native.CreateSession(msg, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in GRPC_REFUSALS | {grpc.StatusCode.ALREADY_EXISTS}, (exc.code(), exc.details())
        assert exc.details() and "Traceback" not in exc.details()
        return
    native.DeleteSession(apb.DeleteSessionRequest(session=info.session), timeout=30)


@pytest.mark.parametrize("head, twice", [
    ('{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"a":"1","a":"2"}}', "a"),
    ('{"q" :{"dtype":"F32","shape":[1],"data_offsets":[0,4]} , "q"\t:{"dtype":"F32","shape":[1],'
     '"data_offsets":[0,4]}}', "q"),  # whitespace around the colons
    ('{"q":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}}', "shape"),
    ('{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"y":1,"y":2}}}', "y"),  # three levels deep
    ('{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"k\\":":"v","k\\":":"w"}}',
     'k":'),  # an escaped quote in a key
    ('{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"a:":"\\":","a:":"b"}}', "a:"),
])
def test_safetensors_header_duplicates_are_found_however_the_keys_are_written(head, twice):
    """The duplicate check counts keys without a second parse where no string holds an escape; every
    other header is read again: duplicates anywhere are refused, whatever the spacing or escapes."""
    from service.errors import BadRequest
    from service.wire.tensors import parse_safetensors

    with pytest.raises(BadRequest, match="twice") as info:
        parse_safetensors(safetensors_file(head, bytes(4)))
    assert repr(twice) in info.value.message


@pytest.mark.parametrize("head", [
    '{"q" : {"dtype":"F32", "shape":[1], "data_offsets":[0,4]}, "__metadata__" : {"a:b":"c:\\"d\\":"}}',
    '{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"s":"x\\":y"}}',
])
def test_safetensors_headers_with_colons_and_escapes_but_no_duplicate_are_read(head):
    from service.wire.tensors import parse_safetensors

    tensors, metadata = parse_safetensors(safetensors_file(head, bytes(4)))
    assert list(tensors) == ["q"] and len(metadata) == 1


def test_scales_and_caps_past_float32s_range(http, native, oip):
    """The kernels compute in float32: a scale past its range is refused on every transport (it
    would be inf there, and every answer NaN); a cap past it bounds nothing, so the answer is the
    uncapped one, bit for bit."""
    t = qkv(5)
    body = {n: x.tolist() for n, x in t.items()}
    for scale in ("1e39", "-1e300"):
        r = http.post("/attention", params={"scale": scale}, json=body)
        assert "float32" in message(assert_refused(r, {400})), r.text
        r = http.post("/v2/models/attention/infer", json={
            "inputs": [{"name": n, "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}
                       for n, x in t.items()], "parameters": {"scale": float(scale)}})
        assert "float32" in message(assert_refused(r, {400})), r.text
    plain = http.post("/attention", json=body, params={"return_lse": "true"})
    assert plain.status_code == 200, plain.text
    for cap in ("1e39", "1e300"):
        r = http.post("/attention", params={"softcap": cap, "return_lse": "true"}, json=body)
        assert r.status_code == 200 and r.json() == plain.json(), r.text
    msg = {n: grpc_tensor(x) for n, x in t.items()}
    a, b = native.Attend(apb.AttendRequest(**msg), timeout=30), native.Attend(apb.AttendRequest(**msg, softcap=1e300),
                                                                            timeout=30)
    assert a.o.data == b.o.data
    assert grpc_status(native.Attend, apb.AttendRequest(**msg, scale=1e39)) == grpc.StatusCode.INVALID_ARGUMENT


def test_session_sizes_and_q_lengths_of_the_wrong_kind_are_refused(http, native, session):
    """A session's layers are made when it is created: more than MAX_LAYERS is a 422 before any
    is made (a huge count once took the server's memory); q_lengths that is a number, not a list,
    is a 400; nothing is appended and the server keeps serving."""
    from service.sessions.manager import MAX_LAYERS

    for layers in (MAX_LAYERS + 1, 10**12):
        r = http.post("/sessions", json={**SESSION, "layers": layers})
        assert f"1 to {MAX_LAYERS}" in message(assert_refused(r, {422})), r.text
        r = http.post("/v2/models/attention/infer", json={
            "parameters": {"sequence_id": "big", "sequence_start": True, "layers": layers},
            "inputs": [{"name": n, "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}
                       for n, x in qkv().items()]})
        assert f"1 to {MAX_LAYERS}" in message(assert_refused(r, {422})), r.text
    status = grpc_status(native.CreateSession, apb.CreateSessionRequest(layers=2**31 - 1, num_kv_heads=2, head_dim=4,
                                                                        dtype=apb.FLOAT32))
    assert status == grpc.StatusCode.INVALID_ARGUMENT
    r = http.post("/sessions", json={**SESSION, "layers": MAX_LAYERS})
    assert r.status_code == 201, r.text
    assert http.delete(f"/sessions/{r.json()['session']}").status_code == 204
    before = _lengths(http, session)
    r = http.post("/sessions/attend", json={"sessions": [session], "q": [[[1.0, 2, 3, 4]] * 2], "q_lengths": 1})
    assert "q_lengths" in message(assert_refused(r, {400})), r.text
    assert _lengths(http, session) == before
    assert_serving(http, native)


def test_json_numbers_past_a_float_dtypes_range_are_refused(http, native):
    """JSON has no inf, so a number that only fits as inf in the tensor's dtype is a 400 naming
    where it is (it was computed as inf); the largest finite value is served."""
    t = qkv()
    good = {n: t[n].tolist() for n in "kv"}
    nested = t["q"].tolist()
    nested[0][1][2][3] = 1e39  # past float32's 3.4e38
    half = [float(x) for x in t["q"].reshape(-1).tolist()]
    half[5] = 70000.0  # past float16's 65504
    half_kv = {n: {"shape": [1, 2, 3, 4], "dtype": "float16", "data": t[n].reshape(-1).tolist()} for n in "kv"}
    oip = [{"name": n, "shape": [1, 2, 3, 4], "datatype": "FP16",
            "data": half if n == "q" else t[n].reshape(-1).tolist()} for n in "qkv"]
    cases = [
        ("/attention", {"q": nested, **good}, "q[0][1][2][3]"),
        ("/attention", {"q": {"shape": [1, 2, 3, 4], "dtype": "float16", "data": half}, **half_kv}, "q[5]"),
        ("/v2/models/attention/infer", {"inputs": oip}, "q"),
    ]
    for path, doc, where in cases:
        body = assert_refused(http.post(path, json=doc), {400})
        assert where in message(body) and "range of float" in message(body), message(body)
    half[5] = 65504.0
    r = http.post("/attention", json={"q": {"shape": [1, 2, 3, 4], "dtype": "float16", "data": half}, **half_kv})
    assert r.status_code == 200, r.text
    assert_serving(http, native)


@pytest.mark.parametrize("digits", ["²", "¹", "１", "٣"])
def test_layer_numbers_in_other_scripts_digits_are_refused(http, oip, native, session, digits):
    """``str.isdigit`` takes superscripts (which ``int`` refuses: once a 500) and other scripts'
    digits (which ``int`` reads as another number): a layer is written in ASCII digits, on every
    route that takes one; nothing is appended and no session is left behind."""
    before = _lengths(http, session)
    t = qkv(3)
    body = good_safetensors(t)
    r = http.post(f"/sessions/{session}/attend", params={"layer": digits}, content=body, headers={"content-type": ST})
    assert "layer" in message(assert_refused(r, {400})), r.text
    r = http.post("/sessions/attend", json={"sessions": [session], "layer": digits, "q_lengths": [3],
                                            **{n: x[0].transpose(0, 1).tolist() for n, x in t.items()}})
    assert "layer" in message(assert_refused(r, {400})), r.text
    inputs = [{"name": n, "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}
              for n, x in t.items()]
    for parameters in ({"sequence_id": session, "layer": digits},
                       {"sequence_id": "digits", "sequence_start": True, "layers": digits}):
        r = http.post("/v2/models/attention/infer", json={"parameters": parameters, "inputs": inputs})
        assert assert_refused(r, {400}), r.text
    request = tpb.ModelInferRequest(model_name="attention")
    request.parameters["sequence_id"].string_param = session
    request.parameters["layer"].string_param = digits
    for n, x in t.items():
        tensor = request.inputs.add(name=n, datatype="FP32", shape=list(x.shape))
        tensor.contents.fp32_contents.extend(x.flatten().tolist())
    assert grpc_status(oip.ModelInfer, request) == grpc.StatusCode.INVALID_ARGUMENT
    assert _lengths(http, session) == before
    assert http.get("/sessions/digits").status_code == 404
    assert_serving(http, native)


def test_ids_no_session_can_have_are_refused_with_a_short_message(http, native):
    """An id outside the session id syntax is a 400 / INVALID_ARGUMENT on every route that names a
    session (not a 404), and the message quotes at most the id's start: a 20,000-character id once
    made a gRPC status message past the client's 16 KiB metadata limit (RESOURCE_EXHAUSTED)."""
    huge = "x" * 20_000
    for call, msg in ((native.GetSession, apb.GetSessionRequest(session=huge)),
                      (native.DeleteSession, apb.DeleteSessionRequest(session=huge)),
                      (native.CreateSession, apb.CreateSessionRequest(session=huge, layers=1, num_kv_heads=2,
                                                                      head_dim=4, dtype=apb.FLOAT32))):
        with pytest.raises(grpc.RpcError) as err:
            call(msg, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "20000 characters" in err.value.details() and len(err.value.details()) < 1000
    for sid in ("%C3%BC", "a%20b", "x" * 129):
        assert_refused(http.get(f"/sessions/{sid}"), {400})
        assert_refused(http.delete(f"/sessions/{sid}"), {400})
        assert_refused(http.post(f"/sessions/{sid}/attend", content=good_safetensors(qkv()),
                                 headers={"content-type": ST}), {400})
    assert_refused(http.get("/sessions/no-such-session"), {404})
    assert_serving(http, native)


def test_what_a_second_outside_battery_found_is_answered_clearly(http, native, session):
    """OIP ``"outputs": []`` is the default outputs (it was a 500); a binary_data_size that is not an
    integer says so; a compressed body is a 415 on every route (the native ones parsed the gzip
    bytes as the body); option numbers in other scripts' digits or with underscores are refused
    (``scale=1_0`` was 10.0, ``window_size=٣,0`` was (3, 0)); a single step's k/v of the wrong length
    is described in the single step's own shape."""
    t = qkv(5)
    inputs = [{"name": n, "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}
              for n, x in t.items()]
    r = http.post("/v2/models/attention/infer", json={"inputs": inputs, "outputs": []})
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["o"]
    torch.testing.assert_close(torch.tensor(r.json()["outputs"][0]["data"]).view(1, 2, 3, 4), expected(t))
    raw = t["q"].numpy().tobytes()
    for size in ("48", 48.0):
        doc = orjson.dumps({"inputs": [{"name": "q", "shape": [1, 2, 3, 4], "datatype": "FP32",
                                         "parameters": {"binary_data_size": size}}]})
        r = http.post("/v2/models/attention/infer", content=doc + raw,
                      headers={"Inference-Header-Content-Length": str(len(doc))})
        assert "non-negative integer" in message(assert_refused(r, {400})), r.text
    doc = orjson.dumps({"inputs": [{"name": "q", "shape": [1, 2, 3, 4], "datatype": "FP32", "data": [0.0] * 24,
                                     "parameters": {"binary_data_size": 48}}]})
    r = http.post("/v2/models/attention/infer", content=doc + raw,
                  headers={"Inference-Header-Content-Length": str(len(doc))})
    assert "both data and binary_data_size" in message(assert_refused(r, {400})), r.text
    import gzip

    as_json = orjson.dumps({n: x.tolist() for n, x in t.items()})
    for path, ctype, content in (("/attention", ST, good_safetensors(t)), ("/attention", "application/json", as_json),
                                 ("/v2/models/attention/infer", "application/json", orjson.dumps({"inputs": inputs}))):
        r = http.post(path, content=gzip.compress(content), headers={"content-type": ctype, "content-encoding": "gzip"})
        assert "Content-Encoding" in message(assert_refused(r, {415})), r.text
    for params in ({"scale": "1_0"}, {"scale": "١"}, {"window_size": "٣,0"}, {"window_size": "1_0,0"}):
        r = http.post("/attention", params=params, content=good_safetensors(t), headers={"content-type": ST})
        assert list(params)[0] in message(assert_refused(r, {400})), (params, r.text)
    before = _lengths(http, session)
    bad = {"q": t["q"], "k": torch.randn(1, 2, 2, 4), "v": torch.randn(1, 2, 2, 4)}
    r = http.post(f"/sessions/{session}/attend", content=good_safetensors(bad), headers={"content-type": ST})
    text = message(assert_refused(r, {422}))
    assert "N = 3" in text and "packed" not in text, text
    assert _lengths(http, session) == before
    assert_serving(http, native)


def test_what_a_third_outside_battery_found_is_answered_clearly(http, native, oip):
    """Header numbers are decimal digits (``Inference-Header-Content-Length: 2_7_0`` or ``+270`` and
    ``X-Request-Timeout-Ms: 1_000`` were read as Python reads them); an OIP ``id`` that is not a
    string is refused (it was echoed whatever its type); a gRPC OIP input with both typed contents
    and raw_input_contents is refused (the raw data silently won); a softcap under float32's
    smallest normal is refused (0 / cap was NaN with a 200)."""
    t = qkv(6)
    inputs = [{"name": n, "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": 96}}
              for n, x in t.items()]
    doc = orjson.dumps({"inputs": inputs})
    data = doc + b"".join(x.numpy().tobytes() for x in t.values())
    for length in (f"+{len(doc)}", "_".join(str(len(doc))), f"{len(doc)}.0"):
        r = http.post("/v2/models/attention/infer", content=data, headers={"Inference-Header-Content-Length": length})
        assert "Inference-Header-Content-Length" in message(assert_refused(r, {400})), (length, r.text)
    r = http.post("/v2/models/attention/infer", content=data,
                  headers={"Inference-Header-Content-Length": str(len(doc))})
    assert r.status_code == 200, r.text
    for timeout in ("1_000", "1e3", "0x10", "+5"):
        headers = {"content-type": ST, "x-request-timeout-ms": timeout}
        r = http.post("/attention", content=good_safetensors(t), headers=headers)
        assert "X-Request-Timeout-Ms" in message(assert_refused(r, {400})), (timeout, r.text)
    headers = {"content-type": ST, "x-request-timeout-ms": "5000.5"}
    r = http.post("/attention", content=good_safetensors(t), headers=headers)
    assert r.status_code == 200, r.text
    json_inputs = [{"name": n, "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}
                   for n, x in t.items()]
    for bad_id in ({"a": 1}, 5, ["a"], None):
        r = http.post("/v2/models/attention/infer", json={"id": bad_id, "inputs": json_inputs})
        assert '"id" must be a string' in message(assert_refused(r, {400})), (bad_id, r.text)
    r = http.post("/v2/models/attention/infer", json={"id": "x" * 300, "inputs": json_inputs})
    assert r.status_code == 200 and r.json()["id"] == "x" * 300, r.text  # echoed as sent
    req = tpb.ModelInferRequest(model_name="attention")
    for n, x in t.items():
        inp = req.inputs.add(name=n, datatype="FP32", shape=list(x.shape))
        inp.contents.fp32_contents.extend(x.flatten().tolist())
        req.raw_input_contents.append(x.numpy().tobytes())
    with pytest.raises(grpc.RpcError) as err:
        oip.ModelInfer(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "both typed contents" in err.value.details()
    r = http.post("/attention", params={"softcap": "1e-300"}, content=good_safetensors(t), headers={"content-type": ST})
    assert "smallest normal" in message(assert_refused(r, {400, 422})), r.text
    assert_serving(http, native)
