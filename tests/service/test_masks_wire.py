"""Score modifiers (window_size, softcap, alibi_slopes) on every transport, against a real CPU server:
each transport's masked answer equals kernels.attention with the same modifiers and the float64
``masked64`` reference (the transports' answers to one call are bit for bit one another's); bad
values are refused with the error table's status and a message naming the option, on each
transport; a masked call asked of a kernel that takes no modifiers is a 422 saying why; session
steps (single, packed, OIP sequences) with a window equal /attention over the concatenation.
"""

from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from conftest import run_server
from tritonclient.utils import InferenceServerException

import kernels
from service.client import AttentionClient, AttentionServiceError, GrpcAttentionClient
from tests.helpers import assert_close_to_masked

B, HQ, HKV, NQ, NK, D = 2, 4, 2, 7, 12, 16
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SERVER_ARGS = ("--warmup-shapes", "1x1x16x16", "--warmup-dtypes", "float32", "--kv-page-tokens", "5")

# (id, options): a causal window with a cap and shared slopes; a two-sided window with per-row slopes
CASES = [
    ("causal-window-cap-alibi", dict(causal=True, window_size=(3, -1), softcap=5.0, alibi_slopes=SLOPES)),
    ("two-sided-rows", dict(window_size=(2, 1), alibi_slopes=torch.stack([SLOPES, SLOPES.flip(0)]))),
    ("cap-only", dict(softcap=2.0)),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("masks"), *SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with AttentionClient(server.url) as c:
        yield c


@pytest.fixture(scope="module")
def rpc(server):
    with GrpcAttentionClient(server.grpc_target) as c:
        yield c


@pytest.fixture
def server_path(monkeypatch):
    """kernels.attention here on the path the server takes (no TRITON_INTERPRET: the CPU loop)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def qkv(seed=0, b=B, nq=NQ, nk=NK):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, HQ, nq, D, generator=g), torch.randn(b, HKV, nk, D, generator=g),
            torch.randn(b, HKV, nk, D, generator=g))


def ref_opts(opts):
    """The client's keywords -> masked64's."""
    return dict(causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                softcap=opts.get("softcap", 0.0), alibi=opts.get("alibi_slopes"))


def b64(t):
    return {"shape": list(t.shape), "dtype": "float32", "data": base64.b64encode(t.numpy().tobytes()).decode()}


def oip_infer(mod, client, tensors, parameters=None, **kwargs):
    inputs = []
    for name, t in tensors.items():
        inp = mod.InferInput(name, list(t.shape), "FP32")
        inp.set_data_from_numpy(t.numpy())
        inputs.append(inp)
    res = client.infer("attention", inputs, outputs=[mod.InferRequestedOutput("o")], parameters=parameters,
                       **kwargs)
    return torch.from_numpy(np.array(res.as_numpy("o")))


def triton(server, kind):
    if kind == "http":
        return th, th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    return tg, tg.InferenceServerClient(server.grpc_target)


def oip_parameters(opts):
    out = {}
    if "window_size" in opts:
        out["window_size"] = ",".join(map(str, opts["window_size"]))
    if "softcap" in opts:
        out["softcap"] = opts["softcap"]
    if "causal" in opts:
        out["causal"] = opts["causal"]
    return out


@pytest.mark.parametrize("opts", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_every_transport_answers_the_masked_call(server, http, rpc, server_path, opts):
    q, k, v = qkv()
    want, want_lse = kernels.attention(q, k, v, return_lse=True, **opts)
    assert_close_to_masked(want, q, k, v, **ref_opts(opts))
    o, lse = http.attention(q, k, v, return_lse=True, **opts)  # safetensors, options as query parameters
    torch.testing.assert_close(o, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert_close_to_masked(o, q, k, v, **ref_opts(opts))
    answers = {"http": o}
    answers["grpc"] = rpc.attention(q, k, v, **opts)
    doc = {"q": b64(q), "k": b64(k), "v": b64(v), **{n: opts[n] for n in ("causal", "softcap") if n in opts}}
    if "window_size" in opts:
        doc["window_size"] = list(opts["window_size"])  # a JSON list
    if "alibi_slopes" in opts:
        doc["alibi_slopes"] = opts["alibi_slopes"].tolist()  # nested lists: float32
    r = httpx.post(server.url + "/attention", json=doc)
    assert r.status_code == 200, r.text
    out = r.json()["o"]
    answers["json"] = torch.frombuffer(bytearray(base64.b64decode(out["data"])), dtype=torch.float32).view(out["shape"])
    tensors = {"q": q, "k": k, "v": v}
    if "alibi_slopes" in opts:
        tensors["alibi_slopes"] = opts["alibi_slopes"]
    for kind in ("http", "grpc"):
        mod, client = triton(server, kind)
        answers[f"oip-{kind}"] = oip_infer(mod, client, tensors, oip_parameters(opts))
    for name, a in answers.items():
        assert torch.equal(a, o), f"{name} differs from the native HTTP answer"


def test_window_in_safetensors_metadata(server, http):
    from safetensors.torch import save

    q, k, v = qkv(1)
    body = save({"q": q, "k": k, "v": v}, metadata={"window_size": "2,0", "softcap": "4", "causal": "true"})
    r = httpx.post(server.url + "/attention", content=body, headers={"Content-Type": "application/x-safetensors"})
    assert r.status_code == 200, r.text
    from service.wire.tensors import parse_safetensors

    o = parse_safetensors(bytearray(r.content))[0]["o"]
    assert torch.equal(o, http.attention(q, k, v, causal=True, window_size=(2, 0), softcap=4.0))


# (options, status, code, message): one bad value of each option, and a kernel that takes none
BAD = [
    (dict(window_size=(1, 2, 3)), 400, "INVALID_ARGUMENT", r"window_size.*two integers"),
    (dict(window_size=(-2, 0)), 400, "INVALID_ARGUMENT", r"window_size.*>= -1"),
    (dict(softcap=-1.0), 400, "INVALID_ARGUMENT", r"softcap.*>= 0"),
    (dict(softcap=float("inf")), 400, "INVALID_ARGUMENT", r"softcap.*finite"),
    (dict(alibi_slopes=torch.ones(3)), 422, "INVALID_ARGUMENT",
     r"alibi_slopes must have shape \[4\] \(Hq\) or \[2, 4\]"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), 422, "INVALID_ARGUMENT", r"alibi_slopes must be float32"),
    (dict(causal=True, window_size=(3, 0), kernel="flash_v1"), 422, "INVALID_ARGUMENT",
     r"kernel 'flash_v1' cannot run this call \(window_size=\(3, -1\)\): flash_v1 takes no"),
]


@pytest.mark.parametrize(("opts", "status", "code", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_values_are_refused_on_every_transport(server, http, rpc, opts, status, code, message):
    q, k, v = qkv()
    with pytest.raises(AttentionServiceError, match=message) as e:
        http.attention(q, k, v, **opts)
    assert e.value.status == status
    with pytest.raises(AttentionServiceError, match=message) as e:
        rpc.attention(q, k, v, **opts)
    assert e.value.status == grpc.StatusCode[code]
    if "kernel" in opts or "alibi_slopes" in opts and opts["alibi_slopes"].dtype != torch.float32:
        return  # OIP takes no kernel here; tritonclient sends every input as FP32 below
    tensors = {"q": q, "k": k, "v": v}
    if "alibi_slopes" in opts:
        tensors["alibi_slopes"] = opts["alibi_slopes"]
    params = {}
    if "window_size" in opts:
        params["window_size"] = ",".join(map(str, opts["window_size"]))
    if "softcap" in opts:
        params["softcap"] = str(opts["softcap"])
    for kind in ("http", "grpc"):
        mod, client = triton(server, kind)
        with pytest.raises(InferenceServerException, match=message) as e:
            oip_infer(mod, client, tensors, params)
        assert e.value.status() in (str(status), f"StatusCode.{code}"), e.value.message()


def test_json_window_values(server):
    q, k, v = qkv()
    base = {"q": b64(q), "k": b64(k), "v": b64(v)}
    for value, ok in (([3, 0], True), ("3,0", True), ("[3, 0]", True), ([3], False), ([True, 0], False),
                      ("3;0", False), ({"left": 3}, False)):
        r = httpx.post(server.url + "/attention", json={**base, "window_size": value})
        assert (r.status_code == 200) == ok, (value, r.text)
        if not ok:
            assert r.status_code == 400 and "window_size" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/attention", json={**base, "softcap": "lots"})
    assert r.status_code == 400 and "softcap" in r.json()["error"]["message"]


# ---------------------------------------------------------------- sessions


@pytest.mark.parametrize("client_name", ["http", "rpc"])
def test_session_steps_with_a_window_equal_attention_over_the_concatenation(request, http, client_name):
    client = request.getfixturevalue(client_name)
    s = client.create_session(HKV, D, torch.float32)
    opts = dict(window_size=(4, -1), softcap=3.0, alibi_slopes=SLOPES)
    ks, vs = [], []
    for i, n in enumerate([6, 1, 3, 1]):  # prefill, decode, a chunk, decode: the window slides past the start
        q, k, v = qkv(10 + i, b=1, nq=n, nk=n)
        o = client.step(s, q, k, v, **opts)
        ks.append(k)
        vs.append(v)
        kk, vv = torch.cat(ks, 2), torch.cat(vs, 2)
        want = http.attention(q, kk, vv, causal=True, **opts)
        torch.testing.assert_close(o, want, rtol=1e-6, atol=1e-6)
        assert_close_to_masked(o, q, kk, vv, causal=True, window=(4, -1), softcap=3.0, alibi=SLOPES)
    s.delete()


@pytest.mark.parametrize("client_name", ["http", "rpc"])
def test_packed_steps_take_per_session_slopes(request, http, client_name):
    client = request.getfixturevalue(client_name)
    sessions = [client.create_session(HKV, D, torch.float32) for _ in range(2)]
    slopes = torch.stack([SLOPES, SLOPES * 3])  # (S, Hq)
    prefill = [qkv(30 + i, b=1, nq=n, nk=n) for i, n in enumerate((5, 8))]
    for s, (q, k, v) in zip(sessions, prefill, strict=True):
        client.step(s, q, k, v)
    steps = [qkv(40 + i, b=1, nq=n, nk=n) for i, n in enumerate((2, 3))]
    # packed: (T, H, D) rows of each session
    q = torch.cat([t[0][0].transpose(0, 1) for t in steps])
    k = torch.cat([t[1][0].transpose(0, 1) for t in steps])
    v = torch.cat([t[2][0].transpose(0, 1) for t in steps])
    o = client.packed_step(sessions, q, k, v, [2, 3], window_size=(3, -1), alibi_slopes=slopes)
    at = 0
    for i, ((q1, k1, v1), (_, kp, vp)) in enumerate(zip(steps, prefill, strict=True)):
        kk, vv = torch.cat([kp, k1], 2), torch.cat([vp, v1], 2)
        want = http.attention(q1, kk, vv, causal=True, window_size=(3, -1), alibi_slopes=slopes[i])
        n = q1.shape[2]
        torch.testing.assert_close(o[at : at + n], want[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        at += n
    with pytest.raises(AttentionServiceError, match=r"alibi_slopes must have shape \[4\] \(Hq\) or \[2, 4\] "
                                                    r"\(S, Hq\)") as e:
        client.packed_step(sessions, q, None, None, [2, 3], alibi_slopes=torch.ones(3, 4))
    assert e.value.status in (422, grpc.StatusCode.INVALID_ARGUMENT)
    # a side past any sequence is unbounded (no kernel argument overflows): the plain answer
    q1 = q[:1].transpose(0, 1)[None]  # (1, Hq, 1, D), a q-only step
    assert torch.equal(client.step(sessions[0], q1, window_size=(2**62, 0)), client.step(sessions[0], q1))
    with pytest.raises(AttentionServiceError, match=r"window_size.*>= -1") as e:
        client.step(sessions[0], q1, window_size=(-5, 0))
    assert e.value.status in (400, grpc.StatusCode.INVALID_ARGUMENT)
    for s in sessions:
        s.delete()


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_oip_sequence_steps_take_the_modifiers(server, http, kind):
    mod, client = triton(server, kind)
    seq = f"masked-{kind}"
    params = {"window_size": "2,-1", "softcap": 4.0}
    ks, vs = [], []
    for i, n in enumerate([5, 1, 1]):
        q, k, v = qkv(60 + i, b=1, nq=n, nk=n)
        ks.append(k)
        vs.append(v)
        o = oip_infer(mod, client, {"q": q, "k": k, "v": v, "alibi_slopes": SLOPES}, params, sequence_id=seq,
                      sequence_start=i == 0)
        want = http.attention(q, torch.cat(ks, 2), torch.cat(vs, 2), causal=True, window_size=(2, -1),
                              softcap=4.0, alibi_slopes=SLOPES)
        torch.testing.assert_close(o, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(InferenceServerException, match="softcap") as e:
        oip_infer(mod, client, {"q": q}, {"softcap": -2.0}, sequence_id=seq)
    assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    http.delete_session(seq)
