"""Sessions through the Open Inference Protocol's sequence parameters (docs/api.md#sessions), driven by
tritonclient's own ``infer(..., sequence_id=, sequence_start=, sequence_end=)`` over HTTP and gRPC
against a real CPU server: a prefill and a decode loop equal /attention over the concatenation; a
second start is 409 / ALREADY_EXISTS; the session is gone after sequence_end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from conftest import run_server
from tritonclient.utils import InferenceServerException

from service.client import AttentionClient

HKV, HQ, D = 2, 4, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ("--warmup-shapes", "1x1x16x16", "--warmup-dtypes", "float32", "--kv-page-tokens", "5")
    with run_server(tmp_path_factory.mktemp("sessions-oip"), *args) as s:
        yield s


@pytest.fixture(scope="module")
def native(server):
    with AttentionClient(server.url) as c:
        yield c


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def triton(server, kind):
    if kind == "http":
        return th, th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    return tg, tg.InferenceServerClient(server.grpc_target)


def infer(mod, client, tensors, **kwargs):
    inputs = []
    for name, t in tensors.items():
        inp = mod.InferInput(name, list(t.shape), "FP32")
        inp.set_data_from_numpy(t.numpy())
        inputs.append(inp)
    outputs = [mod.InferRequestedOutput(n) for n in kwargs.pop("outputs", ("o",))]
    res = client.infer("attention", inputs, outputs=outputs, **kwargs)
    return {o: torch.from_numpy(np.array(res.as_numpy(o))) for o in ("o", "lse") if res.as_numpy(o) is not None}


@pytest.mark.parametrize("kind", ["http", "grpc"])
@pytest.mark.parametrize("seq", [17, "chat-7"])
def test_prefill_and_decode_through_sequence_parameters(server, native, kind, seq):
    seq = seq if isinstance(seq, str) else seq + (kind == "grpc")  # one id per case
    seq = f"{seq}-{kind}" if isinstance(seq, str) else seq
    mod, client = triton(server, kind)
    ks, vs, seed = [], [], 0
    for i, n in enumerate([6, 1, 1, 1]):  # prefill, then decode
        q, k, v = rand(1, HQ, n, D, seed=seed), rand(1, HKV, n, D, seed=seed + 1), rand(1, HKV, n, D, seed=seed + 2)
        seed += 3
        ks.append(k)
        vs.append(v)
        out = infer(mod, client, {"q": q, "k": k, "v": v}, sequence_id=seq, sequence_start=i == 0,
                    sequence_end=False, outputs=("o", "lse"))
        kk, vv = torch.cat(ks, 2), torch.cat(vs, 2)
        o, lse = native.attention(q, kk, vv, causal=True, return_lse=True)
        torch.testing.assert_close(out["o"], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["lse"], lse, rtol=1e-5, atol=1e-5)
        if i == 0:  # a second start on the live id
            with pytest.raises(InferenceServerException) as e:
                infer(mod, client, {"q": q, "k": k, "v": v}, sequence_id=seq, sequence_start=True)
            assert e.value.status() in ("409", "StatusCode.ALREADY_EXISTS"), e.value.message()
    assert native.get_session(str(seq))["lengths"] == [9]
    q = rand(1, HQ, 1, D, seed=99)  # q-only, non-causal, the last step
    out = infer(mod, client, {"q": q}, sequence_id=seq, sequence_end=True, parameters={"causal": False})
    torch.testing.assert_close(out["o"], native.attention(q, torch.cat(ks, 2), torch.cat(vs, 2)), rtol=1e-5, atol=1e-5)
    with pytest.raises(InferenceServerException) as e:  # gone after sequence_end
        infer(mod, client, {"q": q}, sequence_id=seq)
    assert e.value.status() in ("404", "StatusCode.NOT_FOUND"), e.value.message()
    with pytest.raises(Exception, match="not_found|no session"):
        native.get_session(str(seq))


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_layers_layer_and_a_start_without_keys(server, native, kind):
    mod, client = triton(server, kind)
    seq = 1000 + (kind == "grpc")
    q, k, v = rand(1, HQ, 3, D, seed=1), rand(1, HKV, 3, D, seed=2), rand(1, HKV, 3, D, seed=3)
    with pytest.raises(InferenceServerException, match="k and v"):
        infer(mod, client, {"q": q}, sequence_id=seq, sequence_start=True)
    infer(mod, client, {"q": q, "k": k, "v": v}, sequence_id=seq, sequence_start=True, parameters={"layers": 2})
    out = infer(mod, client, {"q": q, "k": k, "v": v}, sequence_id=seq, parameters={"layer": 1})
    torch.testing.assert_close(out["o"], native.attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    info = native.get_session(str(seq))
    assert info["layers"] == 2 and info["lengths"] == [3, 3] and info["num_kv_heads"] == HKV
    with pytest.raises(InferenceServerException, match="out of range"):
        infer(mod, client, {"q": q}, sequence_id=seq, parameters={"layer": 2})
    # parameters a step cannot honour are refused, not dropped: the kernel (steps run the paged
    # kernels) and the layer count past the start
    for parameters, words in (({"kernel": "flash"}, "no 'kernel'"), ({"kernel": "bogus"}, "no 'kernel'"),
                              ({"layers": 3}, "sequence_start only")):
        with pytest.raises(InferenceServerException, match=words) as e:
            infer(mod, client, {"q": q, "k": k, "v": v}, sequence_id=seq, parameters=parameters)
        assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), e.value.message()
    assert native.get_session(str(seq))["lengths"] == [3, 3]
    # sequence_id 0 is no session: a plain (non-causal) attention call
    out = infer(mod, client, {"q": q, "k": k, "v": v}, sequence_id=0)
    torch.testing.assert_close(out["o"], native.attention(q, k, v), rtol=1e-5, atol=1e-5)
    native.delete_session(str(seq))


def test_a_stream_s_sequence_steps_take_effect_in_stream_order(server, native):
    """ModelStreamInfer: a big prefill chunk (sequence_start, 8 MiB), a second big chunk (1.5 MiB)
    and decode steps of one sequence, sent back to back on one stream: each is answered as if
    the ones before it had run. (Big stateless calls are converted in threads, which may finish
    out of order; a sequence's calls are converted inline, in stream order.)"""
    hq, hkv, d = 8, 8, 32
    sizes = [2700, 500, 1, 1]  # q, k, v of 2,700 tokens: ~8 MiB of float32
    ks, vs, qs = [], [], []
    for i, n in enumerate(sizes):
        qs.append(rand(1, hq, n, d, seed=50 + 3 * i))
        ks.append(rand(1, hkv, n, d, seed=51 + 3 * i))
        vs.append(rand(1, hkv, n, d, seed=52 + 3 * i))
    answers = []
    c = tg.InferenceServerClient(server.grpc_target)
    c.start_stream(callback=lambda result, error: answers.append((result, error)))
    for i in range(len(sizes)):
        inputs = []
        for name, t in (("q", qs[i]), ("k", ks[i]), ("v", vs[i])):
            inp = tg.InferInput(name, list(t.shape), "FP32")
            inp.set_data_from_numpy(t.numpy())
            inputs.append(inp)
        c.async_stream_infer("attention", inputs, request_id=str(i), sequence_id="ordered", sequence_start=i == 0,
                             sequence_end=i == len(sizes) - 1, outputs=[tg.InferRequestedOutput("o")])
    c.stop_stream()
    assert all(e is None for _, e in answers), [str(e) for _, e in answers if e is not None]
    got = {r.get_response().id: torch.from_numpy(np.array(r.as_numpy("o"))) for r, _ in answers}
    for i in range(len(sizes)):
        want = native.attention(qs[i], torch.cat(ks[: i + 1], 2), torch.cat(vs[: i + 1], 2), causal=True)
        torch.testing.assert_close(got[str(i)], want, rtol=1e-5, atol=1e-5)


def test_sequence_parameters_that_name_no_sequence_are_refused(server):
    """``sequence_id`` 0.0 or false (equal to 0 in Python) and a sequence_start or sequence_end
    without a sequence_id ran a plain non-causal call with a 200; they are 400s."""
    import httpx

    q, k, v = rand(1, HQ, 3, D, seed=4), rand(1, HKV, 3, D, seed=5), rand(1, HKV, 3, D, seed=6)
    inputs = [{"name": n, "shape": list(t.shape), "datatype": "FP32", "data": t.flatten().tolist()}
              for n, t in (("q", q), ("k", k), ("v", v))]
    cases = [({"sequence_id": 0.0}, "sequence_id"), ({"sequence_id": False}, "sequence_id"),
             ({"sequence_start": True}, "needs a sequence_id"), ({"sequence_id": "", "sequence_start": True},
                                                                 "needs a sequence_id"),
             ({"sequence_id": 0, "sequence_end": True}, "needs a sequence_id"),
             ({"sequence_id": 2**70, "sequence_start": True}, "past 64 bits; send such an id as a string"),
             ({"sequence_id": -1, "sequence_start": True}, "must be an integer >= 0 or a string")]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for params, words in cases:
            r = http.post("/v2/models/attention/infer", json={"inputs": inputs, "parameters": params})
            assert r.status_code == 400 and words in r.json()["error"], (params, r.text)
        r = http.post("/v2/models/attention/infer", json={"inputs": inputs, "parameters": {"sequence_id": 0,
                                                                                           "sequence_start": False}})
        assert r.status_code == 200, r.text
