"""Open Inference Protocol over gRPC, driven by Triton's own client (``tritonclient.grpc``, unchanged)
against a real server: health, metadata, ModelInfer (FP16/BF16/FP32, parameters in each form, layer
models), ModelStreamInfer, and error statuses; and the same calls over HTTP (``tritonclient.http``),
which must give the same answers and the same errors (both transports share ``service.wire.oip``).

This module must not import ``service.grpc.oip``: tritonclient registers the same ``inference.*``
messages in protobuf's default descriptor pool.
"""

from __future__ import annotations

import queue
import threading

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from conftest import run_server
from layer_fixtures import write_bert
from test_grpc import FAST_WARMUP, make_qkv
from tritonclient.utils import InferenceServerException

from service import errors
from service.layers import load_layer
from tests.helpers import assert_close_to_reference

NP = {torch.float16: np.float16, torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16,
      torch.int32: np.int32, torch.int64: np.int64}
OIP = {torch.float16: "FP16", torch.float32: "FP32", torch.bfloat16: "BF16", torch.int32: "INT32",
       torch.int64: "INT64"}
API_KEY = "oip-key"


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: go through float32 (exact)
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def infer_input(name: str, t: torch.Tensor) -> tg.InferInput:
    inp = tg.InferInput(name, list(t.shape), OIP[t.dtype])
    inp.set_data_from_numpy(to_numpy(t))
    return inp


def attention_inputs(q, k, v, kv_lengths=None) -> list[tg.InferInput]:
    named = {"q": q, "k": k, "v": v, "kv_lengths": kv_lengths}
    return [infer_input(name, t) for name, t in named.items() if t is not None]


@pytest.fixture(scope="module")
def layer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "bert"
    write_bert(folder, prefix="")  # hidden 40, 5 heads
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, layer_dir):
    with run_server(tmp_path_factory.mktemp("oip"), "--layer", f"bert0={layer_dir}:0", "--api-key", API_KEY,
                    *FAST_WARMUP) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    c = tg.InferenceServerClient(server.grpc_target)
    yield c
    c.close()


HEADERS = {"authorization": f"Bearer {API_KEY}"}


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()  # probes need no key
    assert client.is_model_ready("attention", headers=HEADERS)
    assert client.is_model_ready("bert0", headers=HEADERS)
    assert not client.is_model_ready("nope", headers=HEADERS)
    assert client.get_server_metadata(headers=HEADERS).name == "attnserve"
    meta = client.get_model_metadata("attention", headers=HEADERS)
    assert [i.name for i in meta.inputs] == ["q", "k", "v", "kv_lengths", "alibi_slopes"]
    assert [o.name for o in meta.outputs] == ["o", "lse"]
    layer = client.get_model_metadata("bert0", headers=HEADERS, as_json=True)
    assert layer["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": ["-1", "-1", "40"]}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_infer_matches_reference(client, dtype):
    q, k, v = make_qkv((2, 4, 2, 17, 97, 40), dtype, seed=7)
    result = client.infer("attention", attention_inputs(q, k, v), headers=HEADERS, request_id="r1")
    assert result.get_response().id == "r1"
    assert result.get_output("lse") is None  # lse only when asked for
    assert_close_to_reference(to_torch(result.as_numpy("o")), q, k, v)


@pytest.mark.parametrize("params", [
    {"causal": True, "scale": 0.25, "return_lse": True},  # bool_param / double_param
    {"causal": "true", "scale": "0.25", "return_lse": "True"},  # string_param
    {"causal": 1, "scale": 0.25, "return_lse": 1, "some_unknown": "ignored"},  # int64_param; unknown ignored
], ids=["typed", "strings", "ints"])
def test_parameters_in_each_form(client, params):
    q, k, v = make_qkv((1, 2, 2, 9, 12, 16), torch.float32, seed=1)
    kv_lengths = torch.tensor([10], dtype=torch.int32)
    inputs = attention_inputs(q, k, v, kv_lengths)
    result = client.infer("attention", inputs, parameters=params, headers=HEADERS)
    lse = to_torch(result.as_numpy("lse"))
    assert_close_to_reference(to_torch(result.as_numpy("o")), q, k, v, causal=True, scale=0.25,
                              kv_lengths=kv_lengths, lse=lse)


def test_requested_outputs(client):
    q, k, v = make_qkv((1, 2, 2, 8, 8, 16), torch.float32, seed=2)
    result = client.infer("attention", attention_inputs(q, k, v), outputs=[tg.InferRequestedOutput("lse")],
                          headers=HEADERS)
    assert result.as_numpy("o") is None and result.as_numpy("lse").shape == (1, 2, 8)


def test_layer_model(client, layer_dir):
    x = torch.randn(2, 7, 40, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7, dtype=torch.int64).repeat(2, 1)
    inputs = [infer_input("x", x), infer_input("positions", positions)]
    result = client.infer("bert0", inputs, headers=HEADERS)
    expected = load_layer("bert0", layer_dir, 0).to("cpu").forward(x, kernel="reference")
    torch.testing.assert_close(to_torch(result.as_numpy("y")), expected, atol=1e-5, rtol=1e-5)


def test_stream_infer(client):
    """24 requests on one ModelStreamInfer; one bad request is answered in-band and the stream goes on."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=HEADERS)
    cases = {}
    try:
        for i in range(24):
            dtype = (torch.float16, torch.bfloat16, torch.float32)[i % 3]
            q, k, v = make_qkv((1, 2, 2, 5 + i, 13, 24), dtype, seed=50 + i)
            cases[f"s{i}"] = (q, k, v)
            client.async_stream_infer("attention", attention_inputs(q, k, v), request_id=f"s{i}",
                                      parameters={"causal": i % 2 == 1})
        client.async_stream_infer("attention", attention_inputs(q, k[..., :8], v), request_id="bad")
        got, errors = {}, []
        for _ in range(len(cases) + 1):
            result, error = answers.get(timeout=60)
            if error is not None:
                errors.append(str(error))
            else:
                got[result.get_response().id] = to_torch(result.as_numpy("o"))
    finally:
        client.stop_stream()
    assert len(errors) == 1 and "shape" in errors[0]
    assert sorted(got) == sorted(cases)
    for rid, (q, k, v) in cases.items():
        assert_close_to_reference(got[rid], q, k, v, causal=int(rid[1:]) % 2 == 1)


@pytest.mark.parametrize("case,status", [
    ("unknown model", "StatusCode.NOT_FOUND"),
    ("unknown input", "StatusCode.INVALID_ARGUMENT"),
    ("missing input", "StatusCode.INVALID_ARGUMENT"),
    ("bad parameter", "StatusCode.INVALID_ARGUMENT"),
    ("head dim over 256", "StatusCode.INVALID_ARGUMENT"),
    ("no key", "StatusCode.UNAUTHENTICATED"),
])
def test_errors(client, case, status):
    q, k, v = make_qkv((1, 1, 1, 4, 4, 16), torch.float32, seed=0)
    model, inputs, params, headers = "attention", attention_inputs(q, k, v), None, HEADERS
    if case == "unknown model":
        model = "nope"
    elif case == "unknown input":
        inputs.append(infer_input("w", q))
    elif case == "missing input":
        inputs = inputs[:2]
    elif case == "bad parameter":
        params = {"causal": "maybe"}
    elif case == "head dim over 256":
        inputs = attention_inputs(*make_qkv((1, 1, 1, 4, 4, 300), torch.float16, seed=0))
    elif case == "no key":
        headers = None
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs, parameters=params, headers=headers)
    assert info.value.status() == status, info.value.message()


def test_concurrent_clients(server):
    """Eight threads, each with its own tritonclient, infer at once; every answer is its own."""
    failures = []

    def work(i):
        c = tg.InferenceServerClient(server.grpc_target)
        try:
            q, k, v = make_qkv((1, 4, 4, 32, 32, 32), torch.float16, seed=200 + i)
            o = to_torch(c.infer("attention", attention_inputs(q, k, v), headers=HEADERS).as_numpy("o"))
            assert_close_to_reference(o, q, k, v)
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            failures.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


# ---- both transports, one protocol: the same call over HTTP and gRPC gives the same answer or error ----

# HTTP status -> the gRPC status of the same domain error (service.errors)
GRPC_OF_HTTP = {str(cls.http_status): f"StatusCode.{cls.grpc_code}" for cls in
                (errors.BadRequest, errors.InvalidInput, errors.NotFound, errors.PayloadTooLarge,
                 errors.Unavailable, errors.DeadlineExceeded, errors.Unauthenticated)}


@pytest.fixture(scope="module")
def http_client(server):
    c = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield c
    c.close()


def http_input(name: str, t: torch.Tensor) -> th.InferInput:
    inp = th.InferInput(name, list(t.shape), OIP[t.dtype])
    inp.set_data_from_numpy(to_numpy(t), binary_data=True)
    return inp


def both_ways(http_client, client, model, tensors, parameters=None, outputs=None):
    """(HTTP's answer, gRPC's answer): output name -> tensor, or (status, message) of the error."""
    answers = []
    for c, make_input, requested in ((http_client, http_input, th.InferRequestedOutput),
                                     (client, infer_input, tg.InferRequestedOutput)):
        try:
            result = c.infer(model, [make_input(n, t) for n, t in tensors.items()], parameters=parameters,
                             outputs=None if outputs is None else [requested(o) for o in outputs],
                             headers=dict(HEADERS))  # a copy: tritonclient.http adds its own to it
        except InferenceServerException as exc:
            answers.append((exc.status(), exc.message()))
            continue
        names = [o["name"] if isinstance(o, dict) else o.name for o in result.get_response(
            **({"as_json": True} if c is client else {}))["outputs"]]
        answers.append({n: to_torch(result.as_numpy(n)) for n in names})
    return answers


PARAMETERS = [  # (why, parameters, HTTP status or None for an answer): JSON over HTTP, typed over gRPC
    ("typed", {"causal": True, "scale": 0.25, "return_lse": True, "kernel": "reference"}, None),
    ("strings", {"causal": "true", "scale": "0.25", "return_lse": "True", "kernel": "auto"}, None),
    ("ints", {"causal": 1, "scale": 1, "return_lse": 0}, None),  # int64_param / JSON integers
    ("unknown ignored", {"causal": False, "some_unknown": "x"}, None),
    ("bad kernel", {"kernel": "nope"}, "400"),
    ("kernel not here", {"kernel": "flash"}, "422"),  # Triton, on a CPU server without TRITON_INTERPRET
    ("bad boolean", {"causal": "maybe"}, "400"),
    ("boolean 2", {"return_lse": 2}, "400"),
    ("boolean scale", {"scale": True}, "400"),
    ("infinite scale", {"scale": "inf"}, "400"),
    ("text scale", {"scale": "a quarter"}, "400"),
]


@pytest.mark.parametrize("parameters,status", [p[1:] for p in PARAMETERS], ids=[p[0] for p in PARAMETERS])
def test_both_transports_agree_on_parameters(http_client, client, parameters, status):
    q, k, v = make_qkv((1, 2, 2, 9, 12, 16), torch.float32, seed=4)
    kv_lengths = torch.tensor([10], dtype=torch.int32)
    via_http, via_grpc = both_ways(http_client, client, "attention",
                                   {"q": q, "k": k, "v": v, "kv_lengths": kv_lengths}, parameters)
    if status is None:
        assert isinstance(via_http, dict) and isinstance(via_grpc, dict), (via_http, via_grpc)
        assert via_http.keys() == via_grpc.keys()
        assert all(torch.equal(via_http[n], via_grpc[n]) for n in via_http), parameters
        return
    assert isinstance(via_http, tuple) and isinstance(via_grpc, tuple), (via_http, via_grpc)
    (http_status, http_message), (grpc_status, grpc_message) = via_http, via_grpc
    assert http_status == status, via_http
    assert GRPC_OF_HTTP[http_status] == grpc_status and http_message == grpc_message, (via_http, via_grpc)


def test_both_transports_agree_on_answers(http_client, client):
    """causal, scale, return_lse and kernel change the answer alike over both transports."""
    q, k, v = make_qkv((1, 2, 2, 9, 12, 16), torch.float32, seed=5)
    kv_lengths = torch.tensor([10], dtype=torch.int32)
    tensors = {"q": q, "k": k, "v": v, "kv_lengths": kv_lengths}
    params = {"causal": True, "scale": 0.25, "return_lse": True, "kernel": "reference"}
    via_http, via_grpc = both_ways(http_client, client, "attention", tensors, params)
    assert list(via_http) == list(via_grpc) == ["o", "lse"]
    assert_close_to_reference(via_grpc["o"], q, k, v, causal=True, scale=0.25, kv_lengths=kv_lengths,
                              lse=via_grpc["lse"])
    plain, _ = both_ways(http_client, client, "attention", tensors, {"kernel": "reference"})
    assert list(plain) == ["o"] and not torch.equal(plain["o"], via_http["o"])  # the parameters took effect


CALL_ERRORS = [  # (why, model, which inputs (name -> shape of a float32 tensor), outputs asked for)
    ("unknown output", "attention", {"q": (1, 1, 4, 16), "k": (1, 1, 4, 16), "v": (1, 1, 4, 16)}, ["attn"]),
    ("missing input", "attention", {"q": (1, 1, 4, 16), "k": (1, 1, 4, 16)}, None),
    ("unknown input", "attention", {n: (1, 1, 4, 16) for n in ("q", "k", "v", "w")}, None),
    ("not 4-D", "attention", {n: (1, 4, 16) for n in ("q", "k", "v")}, None),
    ("head dim over 256", "attention", {n: (1, 1, 4, 300) for n in ("q", "k", "v")}, None),
    ("unknown model", "nope", {"x": (1, 2, 40)}, None),
    ("layer output", "bert0", {"x": (1, 2, 40)}, ["o"]),
    ("layer width", "bert0", {"x": (1, 2, 3)}, None),
]


@pytest.mark.parametrize("model,shapes,outputs", [c[1:] for c in CALL_ERRORS], ids=[c[0] for c in CALL_ERRORS])
def test_both_transports_agree_on_errors(http_client, client, model, shapes, outputs):
    tensors = {n: torch.randn(shape) for n, shape in shapes.items()}
    via_http, via_grpc = both_ways(http_client, client, model, tensors, outputs=outputs)
    assert isinstance(via_http, tuple) and isinstance(via_grpc, tuple), (via_http, via_grpc)
    assert GRPC_OF_HTTP[via_http[0]] == via_grpc[0] and via_http[1] == via_grpc[1], (via_http, via_grpc)


def test_server_version_is_the_package_version(http_client, client):
    from importlib import metadata

    version = metadata.version("attnserve")
    assert client.get_server_metadata(headers=HEADERS).version == version
    assert http_client.get_server_metadata(headers=HEADERS)["version"] == version


@pytest.mark.parametrize("parameters", [
    {"causal": True, "scale": 0.5, "return_lse": True, "kernel": "reference"},  # bool_param / JSON
    {"causal": "true", "scale": "0.5", "return_lse": "1", "kernel": "reference"},  # string_param
    {"causal": 1, "scale": 0.5, "return_lse": 1, "kernel": "reference", "other": object()},  # int64_param
], ids=["typed", "strings", "ints"])
def test_one_request_from_each_form(parameters):
    """``wire.oip.build_call`` (what both transports call) reads each form of a parameter alike."""
    from service.wire import oip

    q = torch.randn(1, 2, 3, 8)
    call = oip.build_call(oip.ATTENTION_MODEL, {"q": q, "k": q, "v": q}, parameters, None,
                          request_id="r", deadline=None)
    req = call.request
    assert (req.causal, req.scale, req.return_lse, req.kernel, call.outputs) == \
        (True, 0.5, True, "reference", ("o", "lse"))


TRITON_EXTENSION_CALLS = [  # tritonclient's calls of Triton's extensions the server lacks (same names on both)
    ("get_inference_statistics", ()), ("get_inference_statistics", ("attention",)),
    ("get_model_repository_index", ()), ("load_model", ("attention",)), ("unload_model", ("attention",)),
    ("get_system_shared_memory_status", ()), ("register_system_shared_memory", ("r0", "/attnserve-test", 64)),
    ("unregister_system_shared_memory", ()), ("get_cuda_shared_memory_status", ()),
    ("get_trace_settings", ()), ("get_log_settings", ()),
]


def test_triton_extensions_the_server_lacks_say_so(http_client, client):
    """Statistics, the model repository, shared memory, trace and logging: 501 over HTTP and
    UNIMPLEMENTED over gRPC, each saying that attnserve does not implement that extension (not a
    404 'no route', an 'unknown model stats' or grpc's bare 'Method not found!'). gRPC's
    ModelConfig points to HTTP's, which answers."""
    for c, status in ((http_client, "501"), (client, "StatusCode.UNIMPLEMENTED")):
        for name, args in TRITON_EXTENSION_CALLS:
            with pytest.raises(InferenceServerException) as err:
                getattr(c, name)(*args, headers=dict(HEADERS))
            assert err.value.status() == status, (name, err.value)
            assert "attnserve does not implement Triton's" in err.value.message(), (name, err.value)
    with pytest.raises(InferenceServerException, match=r"configuration \(over gRPC\) extension.*over HTTP") as err:
        client.get_model_config("attention", headers=dict(HEADERS))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert http_client.get_model_config("attention", headers=dict(HEADERS))["name"] == "attention"


def test_parameters_of_missing_extensions_are_refused(http_client, client, layer_dir):
    """An output asked for in shared memory or as a classification, and an input in shared memory,
    are refused (501 / UNIMPLEMENTED, naming the parameter), not served as if asked for nothing
    special; sequence parameters sent to a layer model are a 400 (it keeps no sequence), alike over
    both transports."""
    q, k, v = make_qkv((1, 2, 2, 4, 4, 16), torch.float32, seed=8)
    ways = ((http_client, http_input, th.InferRequestedOutput, "501"),
            (client, infer_input, tg.InferRequestedOutput, "StatusCode.UNIMPLEMENTED"))
    for c, make_input, requested, status in ways:
        shm, classes = requested("o"), requested("o", class_count=2)
        shm.set_shared_memory("out0", 256)
        for out, what in ((shm, "'shared_memory_region' asks for Triton's shared memory"),
                          (classes, "'classification' asks for Triton's classification")):
            with pytest.raises(InferenceServerException) as err:
                c.infer("attention", [make_input(n, t) for n, t in (("q", q), ("k", k), ("v", v))], outputs=[out],
                        headers=dict(HEADERS))
            assert err.value.status() == status and what in err.value.message(), err.value
        ins = [make_input(n, t) for n, t in (("q", q), ("k", k), ("v", v))]
        ins[0].set_shared_memory("in0", q.numel() * 4)
        with pytest.raises(InferenceServerException) as err:
            c.infer("attention", ins, headers=dict(HEADERS))
        assert err.value.status() == status and "input 'q'" in err.value.message(), err.value
    x = torch.randn(1, 2, 40)
    for sequence in (dict(sequence_id=7), dict(sequence_id="s", sequence_start=True)):
        messages = []
        for c, make_input, status in ((http_client, http_input, "400"), (client, infer_input,
                                                                           "StatusCode.INVALID_ARGUMENT")):
            with pytest.raises(InferenceServerException) as err:
                c.infer("bert0", [make_input("x", x)], headers=dict(HEADERS), **sequence)
            assert err.value.status() == status and "keeps no sequence" in err.value.message(), err.value
            messages.append(err.value.message())
        assert messages[0] == messages[1]
