"""Sessions over HTTP against real CPU servers (docs/api.md#sessions): steps equal /attention over the whole
K, V and a float64 reference; packed steps equal single ones; concurrency shares launches; failed
steps append nothing; 507, expiry, 404/409/422; DELETE returns the memory."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import safetensors.torch as st
import torch
from conftest import FAST, run_server

from tests.helpers import attention64

HKV, HQ, D = 2, 4, 16  # GQA 2:1; D = 16 the warmed head dim
ST = {"Content-Type": "application/x-safetensors"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("sessions"), *FAST, "--kv-page-tokens", "5") as s:
        yield s  # 5 tokens a page: steps cross page boundaries


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


def create(http, session=None, layers=1, hkv=HKV, d=D, dtype="float32", status=201):
    body = {"layers": layers, "num_kv_heads": hkv, "head_dim": d, "dtype": dtype}
    if session is not None:
        body["session"] = session
    r = http.post("/sessions", json=body)
    assert r.status_code == status, r.text
    return r.json()


def step(http, session, q, k=None, v=None, status=200, **options):
    tensors = {"q": q} if k is None else {"q": q, "k": k, "v": v}
    params = {name: str(value).lower() for name, value in options.items()}
    r = http.post(f"/sessions/{session}/attend", params=params, headers=ST,
                  content=st.save({n: t.contiguous().clone() for n, t in tensors.items()}))
    assert r.status_code == status, r.text
    return st.load(r.content) if status == 200 else r.json()


def attention(http, q, k, v, **options):
    params = {name: str(value).lower() for name, value in options.items()}
    r = http.post("/attention", params=params, headers=ST,
                  content=st.save({"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous()}))
    assert r.status_code == 200, r.text
    return st.load(r.content)


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def lengths(http, session):
    return http.get(f"/sessions/{session}").json()["lengths"]


def metric(http, name):
    text = http.get("/metrics").text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_steps_equal_attention_over_the_whole_cache_and_float64(http):
    """Chunked prefill then decode on two layers: each step's o equals POST /attention of q over
    the layer's concatenated keys (bottom-right causal), and the float64 reference."""
    sid = create(http, layers=2)["session"]
    ks, vs = {0: [], 1: []}, {0: [], 1: []}
    for i, (n, layer) in enumerate([(7, 0), (3, 1), (1, 0), (4, 0), (1, 1), (1, 0)]):
        q, k, v = rand(1, HQ, n, D, seed=3 * i), rand(1, HKV, n, D, seed=3 * i + 1), rand(1, HKV, n, D, seed=3 * i + 2)
        got = step(http, sid, q, k, v, layer=layer, return_lse=True)
        ks[layer].append(k)
        vs[layer].append(v)
        kk, vv = torch.cat(ks[layer], 2), torch.cat(vs[layer], 2)
        want = attention(http, q, kk, vv, causal=True, return_lse=True)
        torch.testing.assert_close(got["o"], want["o"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["lse"], want["lse"], rtol=1e-5, atol=1e-5)
        o64, lse64 = attention64(q, kk, vv, causal=True)
        torch.testing.assert_close(got["o"].double(), o64, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["lse"].double(), lse64, rtol=1e-4, atol=1e-4)
        assert got["o"].shape == (1, HQ, n, D) and got["lse"].shape == (1, HQ, n)
    assert lengths(http, sid) == [7 + 1 + 4 + 1, 3 + 1]
    info = http.get(f"/sessions/{sid}").json()
    assert info["kv_bytes"] == (3 + 1) * 2 * 5 * HKV * D * 4  # 13 keys: 3 pages; 4 keys: 1 page
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["layers"] == 2

    # q-only steps attend to what is held and append nothing; causal=false sees every key; bnhd
    q = rand(1, HQ, 2, D, seed=99)
    kk, vv = torch.cat(ks[0], 2), torch.cat(vs[0], 2)
    got = step(http, sid, q)
    torch.testing.assert_close(got["o"], attention(http, q, kk, vv, causal=True)["o"], rtol=1e-5, atol=1e-5)
    got = step(http, sid, q, causal=False)
    torch.testing.assert_close(got["o"], attention(http, q, kk, vv)["o"], rtol=1e-5, atol=1e-5)
    got = step(http, sid, q.transpose(1, 2), layout="bnhd")
    assert got["o"].shape == (1, 2, HQ, D)
    torch.testing.assert_close(got["o"].transpose(1, 2), attention(http, q, kk, vv, causal=True)["o"],
                               rtol=1e-5, atol=1e-5)
    assert lengths(http, sid) == [13, 4]
    # more query rows than keys held (a decoder's queries against an encoder's cached keys), and an
    # empty layer: as /attention, the first rows see no key under causal (o 0, lse -inf)
    fresh = create(http)["session"]
    for causal in (True, False):
        q = rand(1, HQ, 17, D, seed=98)
        got = step(http, sid, q, causal=causal, return_lse=True)
        want = attention(http, q, kk, vv, causal=causal, return_lse=True)
        torch.testing.assert_close(got["o"], want["o"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["lse"], want["lse"], rtol=1e-5, atol=1e-5)
        empty = step(http, fresh, q, causal=causal, return_lse=True)
        assert (empty["o"] == 0).all() and torch.isneginf(empty["lse"]).all()
    assert lengths(http, sid) == [13, 4] and lengths(http, fresh) == [0]

    # end: answered, then released
    got = step(http, sid, q, end=True)
    assert http.get(f"/sessions/{sid}").status_code == 404


def test_json_steps_and_packed_steps_equal_single_steps(http):
    sizes = [3, 1, 6]  # prefill lengths per session
    sids = [create(http)["session"] for _ in sizes]
    for i, (sid, n) in enumerate(zip(sids, sizes, strict=True)):
        step(http, sid, rand(1, HQ, n, D, seed=i), rand(1, HKV, n, D, seed=10 + i), rand(1, HKV, n, D, seed=20 + i))
    twins = [create(http)["session"] for _ in sizes]  # the same history, stepped one by one
    for i, (sid, n) in enumerate(zip(twins, sizes, strict=True)):
        step(http, sid, rand(1, HQ, n, D, seed=i), rand(1, HKV, n, D, seed=10 + i), rand(1, HKV, n, D, seed=20 + i))
    new = [2, 1, 3]
    qs = [rand(n, HQ, D, seed=40 + i) for i, n in enumerate(new)]
    ks = [rand(n, HKV, D, seed=50 + i) for i, n in enumerate(new)]
    vs = [rand(n, HKV, D, seed=60 + i) for i, n in enumerate(new)]
    body = st.save({"q": torch.cat(qs), "k": torch.cat(ks), "v": torch.cat(vs),
                    "q_lengths": torch.tensor(new, dtype=torch.int32)},
                   metadata={"sessions": ",".join(sids), "return_lse": "true"})
    r = http.post("/sessions/attend", headers=ST, content=body)
    assert r.status_code == 200, r.text
    packed = st.load(r.content)
    assert packed["o"].shape == (6, HQ, D) and packed["lse"].shape == (HQ, 6)
    at = 0
    for i, (sid, n) in enumerate(zip(twins, new, strict=True)):
        # JSON base64 single step on the twin: the same bits as its rows of the packed step
        b64 = {"q": _b64(qs[i].transpose(0, 1)[None]), "k": _b64(ks[i].transpose(0, 1)[None]),
               "v": _b64(vs[i].transpose(0, 1)[None]), "return_lse": True}
        r = http.post(f"/sessions/{sid}/attend", json=b64)
        assert r.status_code == 200, r.text
        one = _unb64(r.json()["o"])
        assert torch.equal(one[0].transpose(0, 1), packed["o"][at : at + n])
        assert torch.equal(_unb64(r.json()["lse"])[0], packed["lse"][:, at : at + n])
        at += n
    assert [lengths(http, s)[0] for s in sids] == [a + b for a, b in zip(sizes, new, strict=True)]
    # JSON packed, q_lengths as a list, q-only
    r = http.post("/sessions/attend", json={"sessions": sids[:2], "q": torch.cat(qs[:2]).tolist(), "q_lengths": [2, 1]})
    assert r.status_code == 200, r.text
    assert torch.tensor(r.json()["o"]).shape == (3, HQ, D)


def test_steps_say_where_the_server_time_went(http):
    """A step's and a packed step's answers carry the phases of /attention's Server-Timing (read,
    decode, the engine's queue, stage, launch, device and return, then encode), in that order,
    non-negative, adding up to less than the call."""
    sid = create(http)["session"]
    names = ["read", "decode", "queue", "stage", "launch", "device", "return", "encode"]
    q, k, v = rand(1, HQ, 2, D, seed=1), rand(1, HKV, 2, D, seed=2), rand(1, HKV, 2, D, seed=3)
    calls = [(f"/sessions/{sid}/attend", st.save({"q": q, "k": k, "v": v})),
             ("/sessions/attend", st.save({"q": q[0].transpose(0, 1).contiguous(), "q_lengths": torch.tensor(
                 [2], dtype=torch.int32)}, metadata={"sessions": sid}))]
    for path, body in calls:
        t0 = time.perf_counter()
        r = http.post(path, headers=ST, content=body)
        wall_ms = 1e3 * (time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        phases = [part.strip().split(";dur=") for part in r.headers["server-timing"].split(",")]
        assert [name for name, _ in phases] == names, phases
        durations = [float(d) for _, d in phases]
        assert all(d >= 0 for d in durations) and sum(durations) < wall_ms, (durations, wall_ms)


def _b64(t):
    import base64

    data = base64.b64encode(t.contiguous().numpy().tobytes()).decode()
    return {"shape": list(t.shape), "dtype": "float32", "data": data}


def _unb64(doc):
    import base64

    import numpy as np

    return torch.from_numpy(np.frombuffer(base64.b64decode(doc["data"]), dtype=np.float32).copy()).reshape(doc["shape"])


def test_many_sessions_step_concurrently_and_share_launches(http):
    """32 sessions of different lengths step from 32 threads at once: each answer is right (against
    /attention over its own keys) and the steps share launches."""
    n_sessions, rounds = 32, 3
    sids = [create(http)["session"] for _ in range(n_sessions)]
    history = {sid: ([], []) for sid in sids}
    launches0 = metric(http, "attnserve_session_batch_size_count")
    steps0 = metric(http, "attnserve_session_batch_size_sum")
    errors, answers = [], {}
    barrier = threading.Barrier(n_sessions)

    def run(i, sid):
        try:
            with httpx.Client(base_url=http.base_url, timeout=60.0) as c:
                for r in range(rounds):
                    n = 1 + (i + r) % 4
                    q, k, v = (rand(1, h, n, D, seed=1000 * i + 10 * r + j) for j, h in enumerate((HQ, HKV, HKV)))
                    barrier.wait()
                    answers[sid, r] = (q, k, v, step(c, sid, q, k, v))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i, sid)) for i, sid in enumerate(sids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for sid in sids:
        ks, vs = history[sid]
        for r in range(rounds):
            q, k, v, got = answers[sid, r]
            ks.append(k)
            vs.append(v)
            o64, _ = attention64(q, torch.cat(ks, 2), torch.cat(vs, 2), causal=True)
            torch.testing.assert_close(got["o"].double(), o64, rtol=1e-4, atol=1e-4)
        assert lengths(http, sid) == [sum(k.shape[2] for k in ks)]
    launches = metric(http, "attnserve_session_batch_size_count") - launches0
    steps = metric(http, "attnserve_session_batch_size_sum") - steps0
    assert steps == n_sessions * rounds
    assert launches < steps / 2, (launches, steps)  # steps shared launches


def test_a_failed_step_appends_nothing(http):
    sid = create(http, "fails.1")["session"]
    step(http, sid, rand(1, HQ, 3, D, seed=1), rand(1, HKV, 3, D, seed=2), rand(1, HKV, 3, D, seed=3))
    bad = [
        ({"q": rand(1, HQ, 2, D, seed=4), "k": rand(1, 1, 2, D, seed=5), "v": rand(1, 1, 2, D, seed=6)}, {}, 422),
        ({"q": rand(1, HQ, 2, 8, seed=4)}, {}, 422),  # head dim not the session's
        ({"q": rand(1, HQ, 2, D, seed=4).half()}, {}, 422),  # dtype not the session's
        ({"q": rand(1, HQ, 2, D, seed=4)}, {"layer": "1"}, 422),  # layer out of range
        ({"q": rand(1, HQ, 2, D, seed=4), "k": rand(1, HKV, 2, D, seed=5)}, {}, 400),  # k without v
        ({"q": rand(1, HQ, 2, D, seed=4)}, {"casual": "true"}, 400),  # unknown option
        ({"q": rand(1, HQ, 2, D, seed=4), "k": rand(1, HKV, 2, D, seed=5), "v": rand(1, HKV, 2, D, seed=6)},
         {"_timeout": "0"}, 504),
    ]
    for tensors, params, status in bad:
        headers = dict(ST)
        if "_timeout" in params:
            headers["X-Request-Timeout-Ms"] = params.pop("_timeout")
        r = http.post(f"/sessions/{sid}/attend", params=params, headers=headers, content=st.save(tensors))
        assert r.status_code == status, (params, r.text)
        assert set(r.json()["error"]) == {"code", "message"}
        assert lengths(http, sid) == [3]
    # packed: q_lengths not adding up; an unknown session among known ones
    q = rand(3, HQ, D, seed=7)
    r = http.post("/sessions/attend", json={"sessions": [sid], "q": q.tolist(), "q_lengths": [2]})
    assert r.status_code == 422, r.text
    r = http.post("/sessions/attend", json={"sessions": [sid, "nope"], "q": q.tolist(), "q_lengths": [1, 2]})
    assert r.status_code == 404, r.text
    # an empty id in a comma-separated list (it was dropped: the step ran on the others); an option
    # given twice in the query string (the last won)
    for params in ({"sessions": f"{sid},,{sid}"}, {"sessions": f",{sid}"}):
        r = http.post("/sessions/attend", params=params, json={"q": q[:1].tolist(), "q_lengths": [1]})
        assert r.status_code == 400 and "empty id" in r.json()["error"]["message"], (params, r.text)
    r = http.post("/sessions/attend", params={"sessions": " "}, json={"q": q[:1].tolist(), "q_lengths": [1]})
    assert r.status_code == 400 and "names at least one session" in r.json()["error"]["message"], r.text
    r = http.post(f"/sessions/{sid}/attend", params=[("causal", "true"), ("causal", "false")], headers=ST,
                  content=st.save({"q": rand(1, HQ, 2, D, seed=4)}))
    assert r.status_code == 400 and "'causal' is given twice" in r.json()["error"]["message"], r.text
    assert lengths(http, sid) == [3]


def test_a_step_expiring_in_the_queue_lets_no_later_step_overtake_a_failing_one(http):
    """W1 runs long and fails (its deadline passes while it runs: undone); W2 on the same (session,
    layer) expires while queued behind it; W3 comes after. W3 must wait for W1's undo: its answer is
    attention over its own key alone, and the session keeps exactly the keys of the steps answered
    200. (An expired work once freed the pair W1 held, so W3 ran over W1's keys, which the undo
    then took, W3's with them.)"""
    n = 32768

    def post(c, sid, tensors, timeout_ms=None):
        headers = dict(ST) if timeout_ms is None else {**ST, "X-Request-Timeout-Ms": str(timeout_ms)}
        return c.post(f"/sessions/{sid}/attend", headers=headers, content=st.save(tensors))

    big = {"q": rand(1, HQ, n, D, seed=1), "k": rand(1, HKV, n, D, seed=2), "v": rand(1, HKV, n, D, seed=3)}
    scratch = create(http)["session"]
    t0 = time.monotonic()
    assert post(http, scratch, big).status_code == 200
    run_s = time.monotonic() - t0  # how long W1 takes on this machine
    assert http.delete(f"/sessions/{scratch}").status_code == 204
    sid = create(http)["session"]
    one = [{name: rand(1, h, 1, D, seed=10 * i + j) for j, (name, h) in enumerate((("q", HQ), ("k", HKV), ("v", HKV)))}
           for i in range(2)]
    out: dict[str, httpx.Response] = {}

    def send(name, tensors, timeout_ms, delay):
        time.sleep(delay)
        with httpx.Client(base_url=http.base_url, timeout=60.0) as c:
            out[name] = post(c, sid, tensors, timeout_ms)

    threads = [threading.Thread(target=send, args=args) for args in (
        ("w1", big, int(run_s * 1000 / 3), 0.0), ("w2", one[0], 20, run_s / 6), ("w3", one[1], None, run_s / 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = {name: r.status_code for name, r in out.items()}
    assert statuses["w3"] == 200, out["w3"].text
    keys = [(big["k"], big["v"])] if statuses["w1"] == 200 else []
    keys += [(one[0]["k"], one[0]["v"])] if statuses["w2"] == 200 else []
    keys.append((one[1]["k"], one[1]["v"]))
    assert lengths(http, sid) == [sum(k.shape[2] for k, _ in keys)], statuses
    k = torch.cat([k for k, _ in keys], dim=2)
    v = torch.cat([v for _, v in keys], dim=2)
    ref = attention64(one[1]["q"], k, v, causal=True)[0]
    got = st.load(out["w3"].content)["o"]
    assert (got.double() - ref).abs().max() < 1e-4, statuses
    assert http.delete(f"/sessions/{sid}").status_code == 204


def test_a_step_handed_to_the_launcher_expires_at_its_deadline(http):
    """A step whose deadline passes while it waits behind another session's long launch (handed to
    the worker's launcher thread, staged behind it) is answered 504 at its deadline, not when the
    long launch ends, and appends nothing; the long step is answered as usual."""
    n = 12288
    heavy = create(http)["session"]
    step(http, heavy, rand(1, HQ, n, D, seed=1), rand(1, HKV, n, D, seed=2), rand(1, HKV, n, D, seed=3))
    long_q = st.save({"q": rand(1, 8 * HQ, n, D, seed=4)})  # q-only: appends nothing, may run again
    t0 = time.monotonic()
    assert http.post(f"/sessions/{heavy}/attend", headers=ST, content=long_q).status_code == 200
    run_s = time.monotonic() - t0
    light = create(http)["session"]
    one = st.save({"q": rand(1, HQ, 1, D, seed=5), "k": rand(1, HKV, 1, D, seed=6), "v": rand(1, HKV, 1, D, seed=7)})
    done: list[tuple[str, int]] = []

    def long_step():
        with httpx.Client(base_url=http.base_url, timeout=120.0) as c:
            done.append(("long", c.post(f"/sessions/{heavy}/attend", headers=ST, content=long_q).status_code))

    thread = threading.Thread(target=long_step)
    thread.start()
    time.sleep(run_s / 4)  # the long launch runs
    t0 = time.monotonic()
    r = http.post(f"/sessions/{light}/attend", headers={**ST, "X-Request-Timeout-Ms": "50"}, content=one)
    light_s = time.monotonic() - t0
    done.append(("light", r.status_code))
    thread.join()
    assert done == [("light", 504), ("long", 200)], (done, run_s, r.text)
    assert light_s < run_s / 2, (light_s, run_s)  # at its deadline (50 ms), not at the long launch's end
    assert "nothing was appended" in r.json()["error"]["message"]
    assert lengths(http, light) == [0] and lengths(http, heavy) == [n]
    for sid in (heavy, light):
        assert http.delete(f"/sessions/{sid}").status_code == 204


def test_create_get_delete_and_errors(http):
    info = create(http, "seq:7", layers=3, hkv=1, d=40, dtype="bfloat16")
    assert info == {"session": "seq:7", "layers": 3, "num_kv_heads": 1, "head_dim": 40, "dtype": "bfloat16",
                    "lengths": [0, 0, 0], "kv_bytes": 0, "idle_s": 0.0, "device": "cpu"}
    create(http, "seq:7", status=409)
    for bad in ("attend", "..", "a b", "x" * 129):
        create(http, bad, status=400)
    create(http, hkv=0, status=422)
    create(http, d=257, status=422)
    create(http, dtype="int32", status=422)
    create(http, hkv=2**40, status=507)  # a page of it would not fit any cache
    assert http.post("/sessions", json={"head_dim": 8}).status_code == 400
    assert http.post("/sessions", json={"num_kv_heads": 1, "head_dim": 8, "colour": 1}).status_code == 400
    assert "seq:7" in http.get("/sessions").json()["sessions"]
    assert http.get("/sessions/nope").status_code == 404
    r = http.post("/sessions/nope/attend", headers=ST, content=st.save({"q": rand(1, 1, 1, 8, seed=0)}))
    assert r.status_code == 404
    assert http.delete("/sessions/seq:7").status_code == 204
    assert http.delete("/sessions/seq:7").status_code == 404
    assert http.get("/sessions/seq:7").status_code == 404


def test_delete_returns_the_memory(http):
    for sid in http.get("/sessions").json()["sessions"]:  # what earlier tests left
        assert http.delete(f"/sessions/{sid}").status_code == 204
    sids = [create(http)["session"] for _ in range(4)]
    for i, sid in enumerate(sids):
        step(http, sid, rand(1, HQ, 9, D, seed=i), rand(1, HKV, 9, D, seed=i + 1), rand(1, HKV, 9, D, seed=i + 2))
    listing = http.get("/sessions").json()
    assert listing["count"] == 4 and listing["kv_bytes_used"] == 4 * 2 * (2 * 5 * HKV * D * 4)
    assert metric(http, "attnserve_kv_cache_used_bytes") == listing["kv_bytes_used"]
    assert metric(http, "attnserve_sessions") == 4
    for sid in sids:
        assert http.delete(f"/sessions/{sid}").status_code == 204
    listing = http.get("/sessions").json()
    assert listing["count"] == 0 and listing["kv_bytes_used"] == 0 and listing["kv_bytes_capacity"] == 256 << 20


def test_delete_while_steps_are_queued_returns_every_page(http):
    """Steps of one (session, layer) run one at a time, so once the first of 12 concurrent steps has
    answered most of the rest wait queued when the DELETE comes: each step answers 200 or 404, and
    afterwards no page is held."""
    for sid in http.get("/sessions").json()["sessions"]:  # what earlier tests left
        assert http.delete(f"/sessions/{sid}").status_code == 204
    n = 12
    for trial in range(3):
        sid = create(http, f"deleted.{trial}")["session"]
        statuses, errors = [], []
        barrier, answered = threading.Barrier(n + 1), threading.Event()

        def run(i, sid=sid, trial=trial, barrier=barrier, answered=answered, statuses=statuses, errors=errors):
            try:
                with httpx.Client(base_url=http.base_url, timeout=60.0) as c:
                    q, k, v = (rand(1, h, 7, D, seed=100 * trial + 10 * i + j) for j, h in enumerate((HQ, HKV, HKV)))
                    body = st.save({"q": q, "k": k, "v": v})
                    barrier.wait()
                    r = c.post(f"/sessions/{sid}/attend", headers=ST, content=body)
                    statuses.append(r.status_code)
                    answered.set()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                answered.set()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        assert answered.wait(30)
        assert http.delete(f"/sessions/{sid}").status_code == 204
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert set(statuses) <= {200, 404} and 200 in statuses, statuses
        listing = http.get("/sessions").json()
        assert listing["count"] == 0 and listing["kv_bytes_used"] == 0, (trial, sorted(statuses), listing)
        assert metric(http, "attnserve_kv_cache_used_bytes") == 0


def test_cache_full_is_507_and_idle_sessions_expire(tmp_path):
    # 4 KiB of cache: 8 pages of 16 tokens x 1 head x 4 dims x float32, keys and values
    args = (*FAST, "--kv-cache-mb", str(4096 / 2**20), "--kv-page-tokens", "16", "--session-idle-s", "3",
            "--max-sessions", "3")
    with run_server(tmp_path, *args) as s, httpx.Client(base_url=s.url, timeout=30.0) as http:
        a = create(http, "a", hkv=1, d=4)["session"]
        b = create(http, "b", hkv=1, d=4)["session"]
        # one page of 8 heads x 8 dims (8 KiB) is more than the whole cache: refused when created
        err = create(http, "wide", hkv=8, d=8, status=507)
        assert "whole KV cache" in err["error"]["message"] and err["error"]["code"] == "insufficient_storage"
        assert http.get("/sessions/wide").status_code == 404
        kv = rand(1, 1, 48, 4, seed=1)
        step(http, a, rand(1, 1, 48, 4, seed=0), kv, kv)  # 3 pages of 8
        step(http, b, rand(1, 1, 64, 4, seed=0), torch.cat([kv, kv[:, :, :16]], 2), torch.cat([kv, kv[:, :, :16]], 2))
        big = rand(1, 1, 20, 4, seed=2)  # 2 more pages: 9 of 8
        err = step(http, a, big, big, big, status=507)
        assert "free" in err["error"]["message"] and err["error"]["code"] == "insufficient_storage"
        assert lengths(http, a) == [48] and lengths(http, b) == [64]
        got = step(http, a, rand(1, 1, 16, 4, seed=3), big[:, :, :16], big[:, :, :16])  # the last page fits
        assert got["o"].shape == (1, 1, 16, 4) and lengths(http, a) == [64]
        create(http, "c", hkv=1, d=4)
        create(http, "d", hkv=1, d=4, status=507)  # --max-sessions 3
        assert metric(http, "attnserve_kv_cache_pages_free") == 0
        # idle expiry: b and c go after 3 s without a step; a, kept busy, stays
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            step(http, a, rand(1, 1, 1, 4, seed=4))  # q-only: appends nothing
            time.sleep(0.5)
        assert http.get("/sessions").json()["sessions"] == ["a"]
        assert http.get("/sessions/b").status_code == 404
        assert metric(http, "attnserve_session_expired_total") == 2
        assert http.get("/sessions").json()["kv_bytes_used"] == 4 * 2 * 16 * 4 * 4


def _packed_equals_alone(http, dtype: str, hq: int, hkv: int, d: int, n_s: int) -> None:
    """n_s sessions prefill (17 + 13 i rows) then decode in packed steps; twin sessions take the same
    rows one step at a time: each packed answer has the bits of its twin's, within 2x of /attention's
    error against float64 (plus a hair)."""
    tdt = getattr(torch, dtype)
    sids = [create(http, hkv=hkv, d=d, dtype=dtype)["session"] for _ in range(n_s)]
    twins = [create(http, hkv=hkv, d=d, dtype=dtype)["session"] for _ in range(n_s)]
    ks = {i: [] for i in range(n_s)}
    vs = {i: [] for i in range(n_s)}
    for r, sizes in enumerate([[17 + 13 * i for i in range(n_s)], [1] * n_s, [1 + i % 3 for i in range(n_s)]]):
        qs = [rand(n, hq, d, seed=100 * r + i).to(tdt) for i, n in enumerate(sizes)]
        kn = [rand(n, hkv, d, seed=100 * r + 50 + i).to(tdt) for i, n in enumerate(sizes)]
        vn = [rand(n, hkv, d, seed=100 * r + 80 + i).to(tdt) for i, n in enumerate(sizes)]
        body = st.save({"q": torch.cat(qs), "k": torch.cat(kn), "v": torch.cat(vn),
                        "q_lengths": torch.tensor(sizes, dtype=torch.int32)}, metadata={"sessions": ",".join(sids)})
        r_ = http.post("/sessions/attend", headers=ST, content=body)
        assert r_.status_code == 200, r_.text
        packed = st.load(r_.content)["o"]
        at = 0
        for i, n in enumerate(sizes):
            q4, k4, v4 = (t.transpose(0, 1)[None] for t in (qs[i], kn[i], vn[i]))
            alone = step(http, twins[i], q4, k4, v4)["o"][0].transpose(0, 1)
            assert torch.equal(alone, packed[at : at + n])  # batch invariance
            ks[i].append(k4)
            vs[i].append(v4)
            kk, vv = torch.cat(ks[i], 2), torch.cat(vs[i], 2)
            o64, _ = attention64(q4, kk, vv, causal=True)
            ref = attention(http, q4, kk, vv, causal=True)["o"]
            err = (alone.transpose(0, 1)[None].double() - o64).abs().max()
            ref_err = (ref.double() - o64).abs().max()
            assert err <= 2 * ref_err + 1e-3, (err, ref_err)
            at += n
    assert metric(http, "attnserve_session_batch_size_count") >= 1


def test_steps_run_at_once_on_the_loop_have_the_bits_of_queued_ones(http, tmp_path):
    """A step that comes alone runs inline (--session-inline-rows): the same steps on a server that
    always queues them (0) give the same bits, lengths and lse; the counter tells which ran how."""
    def run(c):
        sid = create(c, layers=2)["session"]
        out = []
        for i, (n, layer) in enumerate([(9, 0), (1, 0), (6, 1), (1, 1), (1, 0), (70, 0)]):  # 70 > 64 rows: queued
            q, k, v = (rand(1, h, n, D, seed=7 * i + j) for j, h in enumerate((HQ, HKV, HKV)))
            out.append(step(c, sid, q, k, v, layer=layer, return_lse=True))
        out.append(step(c, sid, rand(1, HQ, 3, D, seed=5)))  # q-only
        return out, lengths(c, sid)

    inline0 = metric(http, "attnserve_session_inline_total")
    inline_out, inline_lengths = run(http)
    assert metric(http, "attnserve_session_inline_total") - inline0 == 6  # all but the 70-row step
    with run_server(tmp_path, *FAST, "--kv-page-tokens", "5", "--session-inline-rows", "0") as s, \
            httpx.Client(base_url=s.url, timeout=60.0) as c:
        queued_out, queued_lengths = run(c)
        assert metric(c, "attnserve_session_inline_total") == 0
    assert inline_lengths == queued_lengths == [9 + 1 + 1 + 70, 6 + 1]
    for a, b in zip(inline_out, queued_out, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_packed_steps_have_the_bits_of_single_steps(http):
    _packed_equals_alone(http, "float32", HQ, HKV, D, n_s=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_steps_match_attention_and_are_batch_invariant(tmp_path, dtype):
    """On a GPU (the Triton paged kernels): 16 sessions (GQA 8:2, D = 128, page 16), as
    ``_packed_equals_alone``."""
    with run_server(tmp_path, "--device", "cuda:0", "--grpc-port", "0", "--kv-page-tokens", "16",
                    "--warmup-shapes", "1x8x128x128", "--warmup-dtypes", dtype) as s, \
            httpx.Client(base_url=s.url, timeout=120.0) as http:
        _packed_equals_alone(http, dtype, 8, 2, 128, n_s=16)


@pytest.mark.gpu
def test_gpu_lone_steps_replay_graphs_with_the_bits_of_packed_ones(tmp_path):
    """On a GPU a lone step replays a CUDA graph of its key (service/sessions/graphs.py) once one is
    captured: twin sessions stepped alone (graphs) and together (a packed step, by its own graphs
    after its keys' first launches) give the same bits, o and lse, for decode rows over keys that
    cross split and table-width bounds, a 3-row step and a q-only step; the counter shows the replays."""
    hq, hkv, d, tdt = 8, 2, 128, torch.bfloat16
    with run_server(tmp_path, "--device", "cuda:0", "--grpc-port", "0", "--kv-page-tokens", "16",
                    "--warmup-shapes", "1x8x128x128", "--warmup-dtypes", "bfloat16") as s, \
            httpx.Client(base_url=s.url, timeout=120.0) as http:
        prefill = [200, 700, 2047, 5000]  # 1 split, 2 splits, a full table row of 128 pages, many splits
        sids = [create(http, hkv=hkv, d=d, dtype="bfloat16")["session"] for _ in prefill]
        twins = [create(http, hkv=hkv, d=d, dtype="bfloat16")["session"] for _ in prefill]
        for i, n in enumerate(prefill):
            q, k, v = (rand(1, h, n, d, seed=10 * i + j).to(tdt) for j, h in enumerate((hq, hkv, hkv)))
            for sid in (sids[i], twins[i]):
                step(http, sid, q, k, v)
        graphs0 = metric(http, "attnserve_session_graph_exec_total")
        rounds = [1] * 10 + [3, 1, 0]  # 0: a q-only step of one row
        for r, n in enumerate(rounds):
            rows = max(n, 1)
            qs = [rand(rows, hq, d, seed=1000 + 10 * r + i).to(tdt) for i in range(len(sids))]
            kn = [rand(rows, hkv, d, seed=2000 + 10 * r + i).to(tdt) for i in range(len(sids))]
            vn = [rand(rows, hkv, d, seed=3000 + 10 * r + i).to(tdt) for i in range(len(sids))]
            tensors = {"q": torch.cat(qs), "q_lengths": torch.tensor([rows] * len(sids), dtype=torch.int32)}
            if n:
                tensors.update(k=torch.cat(kn), v=torch.cat(vn))
            got = http.post("/sessions/attend", params={"return_lse": "true"}, headers=ST,
                            content=st.save(tensors, metadata={"sessions": ",".join(sids)}))
            assert got.status_code == 200, got.text
            packed = st.load(got.content)
            for i, twin in enumerate(twins):
                q4, k4, v4 = (t.transpose(0, 1)[None] for t in (qs[i], kn[i], vn[i]))
                alone = step(http, twin, q4, *((k4, v4) if n else ()), return_lse=True)
                a, b = i * rows, (i + 1) * rows
                assert torch.equal(alone["o"][0].transpose(0, 1), packed["o"][a:b]), (r, i)
                assert torch.equal(alone["lse"][0], packed["lse"][:, a:b]), (r, i)
        assert lengths(http, twins[0]) == lengths(http, sids[0])
        replays = metric(http, "attnserve_session_graph_exec_total") - graphs0
        assert replays >= 8 * len(twins), replays  # all but the first steps of each key


@pytest.mark.gpu
def test_gpu_packed_steps_replay_graphs_with_the_bits_of_launches(tmp_path):
    """A packed step of many sessions replays its key's CUDA graph too: the same sessions and steps
    on a server with graphs and on one without (--graph-max-kib 0) give the same bits, o and lse,
    round after round: decode rows across split and table-width bounds, rows spread unevenly over
    the sessions (one key, other lengths), a 3-row round and a q-only round."""
    hq, hkv, d, tdt = 8, 2, 128, torch.bfloat16
    common = ("--device", "cuda:0", "--grpc-port", "0", "--kv-page-tokens", "16", "--kv-cache-mb", "512",
              "--warmup-shapes", "1x8x128x128", "--warmup-dtypes", "bfloat16")
    prefill = [200, 700, 2047, 5000, 1, 33]
    for name in ("graphs", "none"):
        (tmp_path / name).mkdir()
    with run_server(tmp_path / "graphs", *common) as on, \
            run_server(tmp_path / "none", *common, "--graph-max-kib", "0") as off, \
            httpx.Client(base_url=on.url, timeout=120.0) as h_on, \
            httpx.Client(base_url=off.url, timeout=120.0) as h_off:
        servers = [(h, [create(h, hkv=hkv, d=d, dtype="bfloat16")["session"] for _ in prefill]) for h in (h_on, h_off)]
        for i, n in enumerate(prefill):
            q, k, v = (rand(1, h, n, d, seed=10 * i + j).to(tdt) for j, h in enumerate((hq, hkv, hkv)))
            for h, sids in servers:
                step(h, sids[i], q, k, v)
        graphs0 = metric(h_on, "attnserve_session_graph_exec_total")
        n_s = len(prefill)
        rounds = [[1] * n_s] * 8 + [[2, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 2], [3] * n_s, [1] * n_s, "q-only"]
        for r, rows in enumerate(rounds):
            appends = rows != "q-only"
            rows = rows if appends else [1] * n_s
            t = sum(rows)
            tensors = {"q": rand(t, hq, d, seed=1000 + r).to(tdt), "q_lengths": torch.tensor(rows, dtype=torch.int32)}
            if appends:
                tensors.update(k=rand(t, hkv, d, seed=2000 + r).to(tdt), v=rand(t, hkv, d, seed=3000 + r).to(tdt))
            got = []
            for h, sids in servers:
                res = h.post("/sessions/attend", params={"return_lse": "true"}, headers=ST,
                             content=st.save(tensors, metadata={"sessions": ",".join(sids)}))
                assert res.status_code == 200, res.text
                got.append(st.load(res.content))
            assert torch.equal(got[0]["o"], got[1]["o"]) and torch.equal(got[0]["lse"], got[1]["lse"]), r
        assert [lengths(h, sids[3]) for h, sids in servers] == [[5000 + 8 + 1 + 1 + 3 + 1]] * 2
        replays = metric(h_on, "attnserve_session_graph_exec_total") - graphs0
        assert replays >= 6, replays  # the decode rounds after the first, the uneven and 1-row rounds
        assert metric(h_off, "attnserve_session_graph_exec_total") == 0


@pytest.mark.gpu
def test_gpu_memory_goes_back_to_the_card_once_sessions_end(tmp_path):
    """Sessions' KV pages come out of the GPU and, once every session has ended and the server has
    been idle for --memory-trim-idle-s, the memory torch holds from the card
    (attnserve_gpu_memory_reserved_bytes, what nvidia-smi counts beside the CUDA context) falls to
    its level with no session held, and the tensors' own (attnserve_gpu_memory_used_bytes) near
    zero."""
    hkv, d, n = 8, 128, 16384  # 8 sessions x 16384 keys x 8 heads x 128 x 2 (k, v) x 2 bytes = 512 MiB
    with run_server(tmp_path, "--device", "cuda:0", "--grpc-port", "0", "--memory-trim-idle-s", "1",
                    "--kv-cache-mb", "1024", "--warmup-shapes", "1x8x128x128", "--warmup-dtypes", "bfloat16") as s, \
            httpx.Client(base_url=s.url, timeout=120.0) as http:
        time.sleep(2.5)
        before = metric(http, "attnserve_gpu_memory_reserved_bytes")
        sids = [create(http, hkv=hkv, d=d, dtype="bfloat16")["session"] for _ in range(8)]
        for i, sid in enumerate(sids):
            q, k, v = (rand(1, h, n, d, seed=10 * i + j).to(torch.bfloat16) for j, h in enumerate((hkv, hkv, hkv)))
            step(http, sid, q, k, v)
        held = metric(http, "attnserve_gpu_memory_used_bytes")
        assert held >= 512 << 20, held
        peak = metric(http, "attnserve_gpu_memory_reserved_bytes")  # (the pages may reuse blocks cached before)
        for sid in sids:
            assert http.delete(f"/sessions/{sid}").status_code == 204
        deadline = time.monotonic() + 20
        while metric(http, "attnserve_gpu_memory_reserved_bytes") > before + (32 << 20) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        after = metric(http, "attnserve_gpu_memory_reserved_bytes")
        assert after <= before + (32 << 20), (before / 2**20, after / 2**20)
        assert peak - after >= 512 << 20, (peak / 2**20, after / 2**20)
        assert metric(http, "attnserve_gpu_memory_used_bytes") < 64 << 20
