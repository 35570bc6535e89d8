"""The Engine interface the transports rely on, and graceful shutdown of a real server process."""

from __future__ import annotations

import asyncio
import collections
import gc
import signal
import threading
import time

import pytest
import torch
from conftest import ROOT, run_server
from prometheus_client import generate_latest

import kernels
from service import errors
from service.core.devices import parse_shapes, resolve_devices
from service.core.engine import Engine
from service.core.types import AttentionRequest
from service.settings import load_settings


@pytest.fixture(autouse=True)
def _cpu_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # kernel="auto" -> the CPU blockwise path


def cpu_settings(**overrides):
    return load_settings(["--device", "cpu", "--warmup-shapes", "1x1x8x8"], **overrides)


def qkv(b=1, hq=2, hkv=2, nq=8, nk=8, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, nq, d, generator=g).to(dtype),
        torch.randn(b, hkv, nk, d, generator=g).to(dtype),
        torch.randn(b, hkv, nk, d, generator=g).to(dtype),
    )


def test_masked_requests_batch_only_with_their_own_and_answer_as_alone():
    """Score modifiers are part of the launch key (a plain request never shares a masked launch,
    nor one window another's), per-request ALiBi slopes stack to one row per batch element, and a
    batched answer is bit for bit the answer alone."""
    slopes = torch.tensor([0.5, 0.125, 0.25, 0.0625])
    opts = [
        {"causal": True, "window_size": (3, -1)},
        {"causal": True, "window_size": (5, -1)},
        {"causal": True, "window_size": (3, -1), "softcap": 5.0},
        {"causal": True, "alibi_slopes": slopes},
        {"causal": True, "alibi_slopes": torch.stack([slopes * 2, slopes])},  # (B, Hq)
        {"window_size": (2, 1), "softcap": 3.0, "alibi_slopes": slopes.flip(0)},
        {"causal": True},
    ]

    def request(i: int, seed: int) -> AttentionRequest:
        q, k, v = qkv(b=2, hq=4, hkv=2, nq=7, nk=12, d=16, seed=seed)
        return AttentionRequest(q=q, k=k, v=v, return_lse=True, **opts[i])

    keys = {request(i, 0).launch_key for i in range(len(opts))}
    assert len(keys) == len(opts) - 1  # the two slope requests share a key: slopes are rows, not keys
    assert request(3, 0).launch_key == request(4, 0).launch_key

    async def main():
        engine = Engine(cpu_settings(max_queue_delay_ms=50.0))
        await engine.start()
        try:
            alone = [await engine.attend(request(i, i)) for i in range(len(opts))]
            blocker = asyncio.create_task(engine.attend(AttentionRequest(*qkv(nq=512, nk=512, d=64))))
            await asyncio.sleep(0)  # the blocker launches first: the rest queue behind it and batch
            together = await asyncio.gather(*(engine.attend(request(i, i)) for i in range(len(opts))),
                                            *(engine.attend(request(i, 100 + i)) for i in range(len(opts))))
            await blocker
            return alone, together
        finally:
            await engine.drain()

    alone, together = asyncio.run(main())
    assert together[3].stamps == together[4].stamps == together[10].stamps  # one launch: [Hq] and [B, Hq] rows
    for i, res in enumerate(alone):
        q, k, v = qkv(b=2, hq=4, hkv=2, nq=7, nk=12, d=16, seed=i)
        o, lse = kernels.attention(q, k, v, return_lse=True, **opts[i])
        assert torch.equal(res.o, o) and torch.equal(res.lse, lse), opts[i]
        assert torch.equal(together[i].o, res.o) and torch.equal(together[i].lse, res.lse), opts[i]


def test_masked_call_of_a_kernel_without_modifiers_is_a_422_saying_why():
    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        try:
            with pytest.raises(errors.InvalidInput, match=r"kernel 'flash_v1' cannot run this call "
                               r"\(window_size=\(3, -1\)\): flash_v1 takes no window_size"):
                await engine.attend(AttentionRequest(*qkv(), causal=True, window_size=(3, 0), kernel="flash_v1"))
        finally:
            await engine.drain()

    asyncio.run(main())


def test_sessions_alone_move_the_activity_the_idle_release_watches():
    """Session steps and ends move ``engine.activity``, and ``engine.idle`` is False while a step
    is held: ``server.release_memory_when_idle`` gives back what a server that served only sessions
    left held (it once watched stateless requests alone, and never ran after sessions)."""
    from service.server import release_memory_when_idle
    from service.sessions import SessionStep

    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        released: list[int] = []
        engine.release_cached_host_memory = lambda: released.append(engine.activity)
        watcher = asyncio.create_task(release_memory_when_idle(engine, 0.05, None, False))
        await asyncio.sleep(0.2)
        assert released == []  # nothing came or went since the start
        before = engine.activity
        sid = engine.sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"]
        running = asyncio.ensure_future(engine.sessions.step(SessionStep.single(sid, *qkv())))
        await asyncio.sleep(0)
        assert not engine.idle
        await running
        await engine.sessions.delete(sid)
        assert engine.activity > before and engine.idle
        for _ in range(40):
            await asyncio.sleep(0.05)
            if released:
                break
        assert released == [engine.activity]
        watcher.cancel()
        await engine.drain()

    asyncio.run(main())


def test_an_expiry_sweep_ends_only_the_sessions_it_found_idle():
    """The idle sweep lists the idle sessions, then ends them one by one, each release waiting for
    its worker's launches: a session ended and re-created under the same id meanwhile (and stepped)
    is a new session, not idle; the sweep once ended it by its id (its step then failed)."""
    from service.sessions import SessionStep

    async def main():
        engine = Engine(load_settings(["--device", "cpu", "--warmup-shapes", "1x1x8x8", "--session-idle-s", "1"]))
        await engine.start()
        sessions = engine.sessions
        try:
            busy = asyncio.ensure_future(sessions.schedulers[0].run(lambda cache: time.sleep(2.5)))
            for sid in ("a", "x"):
                sessions.create(session=sid, num_kv_heads=2, head_dim=16, dtype="float32")
            for _ in range(200):  # the sweep has begun: it took "a" and waits for its release
                if "a" not in sessions.list()["sessions"]:
                    break
                await asyncio.sleep(0.02)
            assert "a" not in sessions.list()["sessions"] and not busy.done()
            ended = asyncio.ensure_future(sessions.delete("x"))
            await asyncio.sleep(0)
            sessions.create(session="x", num_kv_heads=2, head_dim=16, dtype="float32")
            step = asyncio.ensure_future(sessions.step(SessionStep.single("x", *qkv(nq=1, nk=1))))
            await busy
            await ended
            result = await step
            assert result.lengths == [1]
            await asyncio.sleep(0.1)
            assert "x" in sessions.list()["sessions"]
        finally:
            await engine.drain()

    asyncio.run(main())


def test_an_oip_sequence_start_whose_caller_goes_away_leaves_no_session():
    """A sequence_start creates the session, then runs its step; a start that fails leaves no
    session behind, and so does one whose caller goes away (the task cancelled, as a hang-up or a
    gRPC deadline does) while its step is queued: a retried start then finds no 409."""
    from service.wire import oip

    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        try:
            busy = asyncio.ensure_future(engine.sessions.schedulers[0].run(lambda cache: time.sleep(0.5)))
            q, k, v = qkv(nq=2, nk=2)
            call = oip.build_call(oip.find_model(engine, "attention", ""), {"q": q, "k": k, "v": v},
                                  {"sequence_id": "seq", "sequence_start": True}, None,
                                  request_id="r", deadline=time.monotonic() + 30)
            start = asyncio.ensure_future(oip.infer(engine, call))
            await asyncio.sleep(0.1)
            assert "seq" in engine.sessions.list()["sessions"] and not start.done()  # queued behind busy
            start.cancel()
            with pytest.raises(asyncio.CancelledError):
                await start
            await busy
            await asyncio.sleep(0.05)
            assert "seq" not in engine.sessions.list()["sessions"]
        finally:
            await engine.drain()

    asyncio.run(main())


def test_ready_only_after_start_and_not_while_draining():
    async def main():
        engine = Engine(cpu_settings())
        assert not engine.ready
        with pytest.raises(errors.Unavailable):
            await engine.attend(AttentionRequest(*qkv()))
        await engine.start()
        assert engine.ready and engine.devices == ["cpu"]
        await engine.drain()
        assert not engine.ready
        with pytest.raises(errors.Unavailable) as info:
            await engine.attend(AttentionRequest(*qkv()))
        assert "draining" in info.value.message

    asyncio.run(main())


def test_a_failed_oip_sequence_start_ends_only_the_session_it_made():
    """A sequence_start queued behind other work; meanwhile another caller ends its session and
    makes a new one under the same id. The start's step then fails (its session ended), and its
    cleanup leaves the other caller's session alone (it once deleted by id)."""
    from service.wire import oip

    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        try:
            busy = asyncio.ensure_future(engine.sessions.schedulers[0].run(lambda cache: time.sleep(0.3)))
            q, k, v = qkv(nq=2, nk=2)
            call = oip.build_call(oip.find_model(engine, "attention", ""), {"q": q, "k": k, "v": v},
                                  {"sequence_id": "seq", "sequence_start": True}, None,
                                  request_id="r", deadline=time.monotonic() + 30)
            start = asyncio.ensure_future(oip.infer(engine, call))
            await asyncio.sleep(0.05)
            assert not start.done()  # its step is queued behind busy
            ending = asyncio.ensure_future(engine.sessions.delete("seq"))
            await asyncio.sleep(0)
            other = engine.sessions.create(session="seq", num_kv_heads=2, head_dim=16, dtype="float32")
            with pytest.raises(errors.NotFound):
                await start
            await asyncio.gather(busy, ending)
            assert engine.sessions.describe("seq")["session"] == other["session"]
        finally:
            await engine.drain()

    asyncio.run(main())


def test_a_step_that_ends_its_session_leaves_a_new_session_of_that_id_alone(monkeypatch):
    """A step with ``end`` is in its launch (a slow kernel); meanwhile a DELETE ends its session
    (the id is free at once) and another caller makes a new one under that id. The step answers
    (it was ordered before the delete) and its ``end`` ends only the session it ran on (it once
    ended whatever the id named by then)."""
    from service.sessions import SessionStep

    paged = kernels.attention_paged
    entered = threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        time.sleep(0.3)
        return paged(*args, **kwargs)

    monkeypatch.setattr(kernels, "attention_paged", slow)

    async def main():
        engine = Engine(cpu_settings(session_inline_rows=0))
        await engine.start()
        try:
            sessions = engine.sessions
            sessions.create(session="seq", num_kv_heads=2, head_dim=16, dtype="float32")
            q, k, v = qkv(nq=2, nk=2)
            step = asyncio.ensure_future(sessions.step(SessionStep.single("seq", q, k, v, end=True)))
            while not entered.is_set():  # its launch has begun (its pages reserved)
                await asyncio.sleep(0.01)
            assert not step.done()
            ending = asyncio.ensure_future(sessions.delete("seq"))
            await asyncio.sleep(0)
            other = sessions.create(session="seq", num_kv_heads=2, head_dim=16, dtype="float32")
            assert (await step).lengths == [2]
            await ending
            assert sessions.describe("seq")["lengths"] == other["lengths"] == [0]
            assert sessions.list()["count"] == 1
            await sessions.delete("seq")
            assert sessions.list()["kv_bytes_used"] == 0
        finally:
            await engine.drain()

    asyncio.run(main())


def test_new_sessions_spread_over_the_workers():
    """Eight sessions made at once on two workers (no pages taken yet, so both caches are as free):
    four on each (every one went to the first worker while the caches stayed equal)."""

    async def main():
        engine = Engine(cpu_settings(device="cpu,cpu"))
        await engine.start()
        try:
            made = [engine.sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"] for _ in range(8)]
            workers = [engine.sessions.table.sessions[sid].worker for sid in made]
            assert sorted(workers) == [0, 0, 0, 0, 1, 1, 1, 1]
        finally:
            await engine.drain()

    asyncio.run(main())


def test_sessions_held_per_worker_follow_creates_and_ends():
    """The table's count of each worker's sessions (what a create picks its worker by, and the
    sessions gauge) follows creations, DELETE and a step's ``end``: after three of worker 0's
    sessions end, the next three new ones go to worker 0."""
    from service.sessions import SessionStep

    async def main():
        engine = Engine(cpu_settings(device="cpu,cpu"))
        await engine.start()
        sessions = engine.sessions
        try:
            made = [sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"] for _ in range(8)]
            on0 = [sid for sid in made if sessions.table.sessions[sid].worker == 0]
            await sessions.delete(on0[0])
            await sessions.delete(on0[1])
            q = torch.randn(1, 2, 1, 16)
            await sessions.step(SessionStep.single(on0[2], q, q, q, end=True))
            assert dict(sessions.table.per_worker) == {0: 1, 1: 4}
            again = [sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"] for _ in range(3)]
            assert [sessions.table.sessions[sid].worker for sid in again] == [0, 0, 0]
            counted = collections.Counter(s.worker for s in sessions.table.sessions.values())
            assert dict(sessions.table.per_worker) == dict(counted) == {0: 4, 1: 4}
            gauge = {s.labels["device"]: s.value for m in engine.metrics.sessions.collect() for s in m.samples}
            assert gauge == {"cpu-0": 4, "cpu-1": 4}, gauge
        finally:
            await engine.drain()

    asyncio.run(main())


def test_a_session_ended_while_the_server_drains_is_ended_not_an_internal_error():
    """DELETE after the drain has stopped the workers' launcher threads (the HTTP and gRPC servers
    still answer then): the session ends (404 afterwards), no 'cannot schedule new futures'."""
    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        sid = engine.sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"]
        await engine.drain()
        await engine.sessions.delete(sid)
        with pytest.raises(errors.NotFound):
            engine.sessions.describe(sid)

    asyncio.run(main())


def test_readyz_is_503_until_the_warm_up_has_run():
    """/readyz (and the OIP ready routes) answer 503 while a worker is still warming, 200 only
    once its warm-up has returned: the warm-up is held at its start until the probes have asked."""
    import httpx

    from service.core.worker import Worker
    from service.http.app import create_app

    async def main():
        settings = cpu_settings()
        engine = Engine(settings)
        engine.prepare()
        worker = engine.workers[0]
        entered, release, warmed = threading.Event(), threading.Event(), []

        def held_warmup():
            entered.set()
            release.wait(30)
            Worker._warmup_kernels(worker)
            warmed.append(True)

        worker._warmup_kernels = held_warmup
        transport = httpx.ASGITransport(app=create_app(engine, settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            start = asyncio.create_task(engine.start())
            assert await asyncio.to_thread(entered.wait, 30)
            for path in ("/readyz", "/v2/health/ready"):
                assert (await http.get(path)).status_code == 503
            assert (await http.get("/healthz")).status_code == 200
            release.set()
            await start
            assert warmed and (await http.get("/readyz")).status_code == 200
        await engine.drain()

    asyncio.run(main())


def test_attend_layout_lse_and_request_id():
    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        q, k, v = qkv(b=2, hq=4, hkv=2, nq=5, nk=9, d=24)
        # bnhd bytes, as a transport hands them over: (B, N, H, D) -> (B, H, N, D) views
        req = AttentionRequest.from_layout(
            q.transpose(1, 2).contiguous(),
            k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(),
            layout="bnhd",
            causal=True,
            return_lse=True,
            request_id="abc-123",
        )
        res = await engine.attend(req)
        await engine.drain()
        return q, k, v, res

    q, k, v, res = asyncio.run(main())
    o, lse = kernels.attention(q, k, v, causal=True, return_lse=True)
    assert res.request_id == "abc-123"
    assert res.o.shape == (2, 5, 4, 24) and res.o.is_contiguous()  # back in the request's layout
    assert torch.equal(res.o, o.transpose(1, 2))
    assert torch.equal(res.lse, lse)


def test_results_carry_their_launch_stamps():
    """Each answer says when its launch was handed to a worker, its inputs staged, its kernel
    enqueued, and the device done (the Server-Timing split): in that order, inside the call;
    requests that shared a launch share its stamps."""

    async def main():
        engine = Engine(cpu_settings(max_queue_delay_ms=50.0))
        await engine.start()
        t0 = time.perf_counter()
        lone = await engine.attend(AttentionRequest(*qkv()))
        t1 = time.perf_counter()
        blocker = asyncio.create_task(engine.attend(AttentionRequest(*qkv(nq=512, nk=512, d=64))))
        await asyncio.sleep(0)  # the blocker launches first: the next three queue behind it, as one batch
        batch = await asyncio.gather(*(engine.attend(AttentionRequest(*qkv(seed=i))) for i in range(3)))
        await blocker
        await engine.drain()
        return t0, lone, t1, batch

    t0, lone, t1, batch = asyncio.run(main())
    assert lone.stamps is not None and t0 < lone.stamps[0] <= lone.stamps[1] <= lone.stamps[2] <= lone.stamps[3] < t1
    assert len({r.stamps for r in batch}) == 1 and batch[0].stamps[0] > lone.stamps[3]


@pytest.mark.parametrize(
    "make, status",
    [
        (lambda: AttentionRequest(*qkv(d=300)), 422),  # head dim > 256
        (lambda: AttentionRequest(*qkv(hq=3, hkv=2)), 422),  # Hq not a multiple of Hkv
        (lambda: AttentionRequest(*qkv(), kernel="fastest"), 400),  # a bad option value
        (lambda: AttentionRequest(*qkv(), kv_lengths=torch.tensor([99], dtype=torch.int32)), 422),
        (lambda: AttentionRequest(*qkv(dtype=torch.float64)), 422),
    ],
)
def test_bad_requests_are_refused_before_queueing(make, status):
    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        with pytest.raises(errors.ServiceError) as info:
            await engine.attend(make())
        held = engine.batcher.held
        ok = await engine.attend(AttentionRequest(*qkv()))  # a bad request harms no other
        text = generate_latest(engine.metrics_registry).decode()
        await engine.drain()
        return info.value, held, ok, text

    exc, held, ok, text = asyncio.run(main())
    assert exc.http_status == status and held == 0 and ok.o is not None
    reason = {400: "bad_request", 422: "invalid_input"}[status]
    assert f'attnserve_inference_request_failure_total{{kind="attention",reason="{reason}"}} 1.0' in text


def test_metrics_registry_has_the_engine_series():
    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        await asyncio.gather(*(engine.attend(AttentionRequest(*qkv(seed=i))) for i in range(4)))
        text = generate_latest(engine.metrics_registry).decode()
        await engine.drain()
        return text

    text = asyncio.run(main())
    for name in (
        "attnserve_inference_request_success_total",
        "attnserve_inference_request_failure_total",
        "attnserve_inference_queue_depth",
        "attnserve_inference_pending_requests",
        "attnserve_inference_queue_duration_seconds_bucket",
        "attnserve_inference_request_duration_seconds_bucket",
        "attnserve_inference_compute_duration_seconds_bucket",
        "attnserve_inference_batch_size_bucket",
        "attnserve_inference_exec_total",
        "attnserve_ready",
    ):
        assert name in text, name
    assert 'attnserve_inference_request_success_total{kind="attention"} 4.0' in text


def test_resolve_devices_and_shapes():
    assert resolve_devices("cpu") == [torch.device("cpu")]
    assert resolve_devices("cpu,cpu") == [torch.device("cpu")] * 2
    if not torch.cuda.is_available():
        assert resolve_devices("auto") == [torch.device("cpu")]
        with pytest.raises(ValueError):
            resolve_devices("cuda:0")
    with pytest.raises(ValueError):
        resolve_devices("tpu")
    assert parse_shapes("1x8x128x64, 2x4x16x8") == [(1, 8, 128, 64), (2, 4, 16, 8)]
    with pytest.raises(ValueError):
        parse_shapes("1x8x128")


@pytest.mark.skipif(not (ROOT / "service" / "http" / "app.py").exists(), reason="needs the HTTP app")
def test_sigterm_drains_requests_in_flight(tmp_path):
    """A real server: SIGTERM with requests in flight; every accepted one is answered, then it exits."""
    import httpx
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    # Distinct Nq per request: distinct batch keys, so they run one after another (~0.1-0.5 s each).
    cases = [qkv(b=1, hq=8, hkv=8, nq=512 + 16 * i, nk=1024, d=64, seed=i) for i in range(6)]
    with run_server(tmp_path, "--warmup-shapes", "1x1x8x8") as server:
        results: dict[int, httpx.Response | Exception] = {}

        def send(i: int) -> None:
            q, k, v = cases[i]
            body = st_save({"q": q, "k": k, "v": v})
            try:
                results[i] = httpx.post(
                    server.url + "/attention?kernel=reference",
                    content=body,
                    timeout=60,
                    headers={"content-type": "application/x-safetensors"},
                )
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                results[i] = exc

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        held, deadline = 0.0, time.monotonic() + 20
        while time.monotonic() < deadline and held < 3:  # until the server holds several
            text = httpx.get(server.url + "/metrics", timeout=5).text
            lines = [x for x in text.splitlines() if x.startswith("attnserve_inference_pending_requests ")]
            held = float(lines[0].split()[1]) if lines else 0.0
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        late = None
        try:
            for _ in range(500):  # until it reports not-ready (draining)
                if httpx.get(server.url + "/readyz", timeout=5).status_code == 503:
                    break
                time.sleep(0.01)
            late = httpx.post(
                server.url + "/attention",
                content=st_save(dict(zip("qkv", qkv(), strict=True))),
                headers={"content-type": "application/x-safetensors"},
                timeout=10,
            )
        except httpx.HTTPError:
            pass  # already closed: also a refusal
        for t in threads:
            t.join(60)
        assert server.proc.wait(timeout=60) == 0, server.log()

    assert held >= 3, "the requests were not in flight when SIGTERM came"
    if late is not None:
        assert late.status_code == 503
    answered = 0
    for i, (q, k, v) in enumerate(cases):
        res = results[i]
        assert isinstance(res, httpx.Response), (res, server.log())
        if res.status_code == 503:  # reached the server after SIGTERM: refused, never half-served
            assert "draining" in res.json()["error"]["message"]
            continue
        assert res.status_code == 200, (res, server.log())
        o = st_load(res.content)["o"]
        assert torch.equal(o, kernels.attention(q, k, v, kernel="reference"))
        answered += 1
    assert answered >= held, "a request the server held when SIGTERM came was not answered"


@pytest.mark.gpu
def test_gpu_idle_release_frees_the_cached_pinned_staging():
    """After a big request on a GPU, torch keeps its pinned staging buffers cached (they count in
    the RSS); ``release_cached_host_memory`` (the idle trim) hands the unused ones back."""

    def blocks() -> int:  # pinned blocks the allocator owns, in use or cached
        gc.collect()  # blocks of earlier tests' objects caught in reference cycles
        return torch.cuda.host_memory_stats().get("allocations.current", 0)

    async def main():
        engine = Engine(load_settings(["--device", "cuda:0", "--warmup-shapes", "1x1x8x64"]))
        await engine.start()
        q, k, v = qkv(b=1, hq=8, hkv=8, nq=2048, nk=2048, d=64, dtype=torch.float16)
        engine.release_cached_host_memory()  # what earlier tests left cached would be reused
        before = blocks()
        result = await engine.attend(AttentionRequest(q=q, k=k, v=v))  # 2 MiB each: a pinned buffer apiece
        assert result.o.is_pinned()
        del result  # o's pinned buffer too is now unused
        # the worker's threads done first: a release right after the answer found one block still
        # in use (the finisher thread answers before its call returns, so
        # its frame may still hold the answers then)
        await engine.drain()
        held = blocks()
        engine.release_cached_host_memory()
        left = blocks()
        return before, held, left

    before, held, left = asyncio.run(main())
    # Blocks, counted from a baseline taken after a collection: in bytes without a baseline one
    # block of an earlier test was still owned.
    assert held > before and left <= before, (before, held, left)  # blocks may be reused within the call


def pinned_body(bodies, n: int) -> memoryview:
    """A body buffer of ``n`` bytes in pinned memory: the first ask only has one made (in a thread)."""
    for _ in range(500):
        body = bodies(n)
        if isinstance(body, memoryview):
            return body
        time.sleep(0.01)
    raise AssertionError("no pinned body buffer was made")


@pytest.mark.gpu
def test_gpu_request_tensors_in_pinned_memory_go_to_the_device_without_a_staging_copy(monkeypatch):
    """A safetensors body that the server read into pinned memory (``http_protocol.BodyBuffers``):
    its q, k and v are sent to the GPU from where they lie, with no copy into a staging buffer
    first, and the answer is the one the same tensors in ordinary memory get."""
    from safetensors.torch import save

    from service.core import staging
    from service.http.uvicorn_patch import BodyBuffers
    from service.wire.tensors import parse_safetensors

    staged: list[int] = []
    concat = staging.concat

    def counting_concat(parts, dtype, pin):
        staged.append(sum(p.nbytes for p in parts))
        return concat(parts, dtype, pin)

    monkeypatch.setattr(staging, "concat", counting_concat)
    q, k, v = qkv(b=2, hq=8, hkv=8, nq=1024, nk=1024, d=64, dtype=torch.float16, seed=3)  # 2 MiB each
    data = save({"q": q, "k": k, "v": v})
    body = pinned_body(BodyBuffers(pinned=True, budget=1 << 30), len(data))
    body[:] = data
    tensors, _ = parse_safetensors(body)
    assert all(t.is_pinned() for t in tensors.values())

    async def main():
        engine = Engine(load_settings(["--device", "cuda:0", "--warmup-shapes", "1x1x8x64"]))
        await engine.start()
        pinned = await engine.attend(AttentionRequest(q=tensors["q"], k=tensors["k"], v=tensors["v"]))
        n_pinned = len(staged)
        plain = await engine.attend(AttentionRequest(q=q, k=k, v=v))
        await engine.drain()
        return pinned, n_pinned, plain

    pinned, n_pinned, plain = asyncio.run(main())
    assert n_pinned == 0 and staged == [q.nbytes, k.nbytes, v.nbytes]  # only the unpinned request was staged
    assert torch.equal(pinned.o, plain.o)
    assert torch.equal(plain.o, kernels.attention(q.cuda(), k.cuda(), v.cuda()).cpu())


@pytest.mark.gpu
def test_gpu_pinned_body_buffers_are_reused_within_their_budget():
    """``BodyBuffers``: pinned buffers are made off the caller's thread, kept within the budget
    (the heap beyond it), reused once nothing views their body, and let go by ``trim`` when free."""
    from service.http.uvicorn_patch import BodyBuffers

    bodies = BodyBuffers(pinned=True, budget=3 << 20)
    a = pinned_body(bodies, 2 << 20)
    assert torch.frombuffer(a, dtype=torch.uint8).is_pinned() and len(a) == 2 << 20
    view = torch.frombuffer(a[100:200], dtype=torch.uint8)  # as parse_safetensors makes them
    address = view.data_ptr() - 100
    assert isinstance(bodies(2 << 20), bytearray)  # a second 2 MiB buffer would pass the budget
    del a
    gc.collect()
    assert isinstance(bodies(2 << 20), bytearray)  # the view still holds the first body
    bodies.trim()  # in use: not let go
    assert bodies.pinned_bytes == 2 << 20
    del view
    gc.collect()
    again = bodies((2 << 20) - 5)
    assert isinstance(again, memoryview) and torch.frombuffer(again, dtype=torch.uint8).data_ptr() == address
    del again
    gc.collect()
    bodies.trim()
    assert bodies.pinned_bytes == 0
    assert isinstance(BodyBuffers(pinned=False, budget=1 << 30)(2 << 20), bytearray)


@pytest.mark.gpu
def test_gpu_staging_of_misaligned_decode_batches():
    """Decode-like requests batched on a GPU: q small (staged in a buffer shared with kv_lengths),
    k/v over 1 MiB (each staged in its own buffer), every input a misaligned view of a bytes
    buffer, kv_lengths int64 (converted): each answer equals the kernel run on its own inputs."""

    def view(buf: bytearray, offset: int, shape, dtype) -> torch.Tensor:
        count = 1
        for s in shape:
            count *= s
        return torch.frombuffer(buf, dtype=dtype, offset=offset, count=count).view(shape)

    def request(seed: int) -> AttentionRequest:
        g = torch.Generator().manual_seed(seed)
        shapes = {"q": (1, 8, 1, 128), "k": (1, 2, 4096, 128), "v": (1, 2, 4096, 128)}
        tensors = {}
        for name, shape in shapes.items():
            buf = bytearray(2 + 2 * torch.Size(shape).numel())
            t = view(buf, 2, shape, torch.float16)  # 2 bytes past a 16-byte boundary
            t.copy_(torch.randn(shape, generator=g))
            tensors[name] = t
        return AttentionRequest(**tensors, kv_lengths=torch.tensor([1000 + 97 * seed]))

    async def main():
        settings = load_settings(["--device", "cuda:0", "--warmup-shapes", "", "--max-queue-delay-ms", "20"])
        engine = Engine(settings)
        await engine.start()
        try:
            reqs = [request(i) for i in range(12)]
            results = await asyncio.gather(*(engine.attend(r) for r in reqs))
            launches = engine.metrics.exec_count.labels("cuda:0")._value.get()
            return reqs, results, launches
        finally:
            await engine.drain()

    reqs, results, launches = asyncio.run(main())
    assert launches < len(reqs), "no batch formed"
    for req, res in zip(reqs, results, strict=True):
        o = kernels.attention(
            req.q.cuda(), req.k.cuda(), req.v.cuda(), kv_lengths=req.kv_lengths.to("cuda", torch.int32)
        )
        assert torch.equal(res.o, o.cpu())


def test_staging_concat_equals_torch_cat():
    """The worker's staging copy (one memmove per small contiguous part, ATen's copy otherwise)
    equals torch.cat, for a misaligned view of request bytes, a non-contiguous part, a part of
    another dtype (converted), an empty part and one over the memmove size; inputs stay as they were."""
    from service.core.staging import SERIAL_COPY_MAX_BYTES, concat

    g = torch.Generator().manual_seed(0)
    raw = bytearray(2 + 2 * 3 * 4 * 8)
    misaligned = torch.frombuffer(raw, dtype=torch.float16, offset=2, count=3 * 4 * 8).view(3, 4, 8)
    misaligned.copy_(torch.randn(3, 4, 8, generator=g))
    big_rows = SERIAL_COPY_MAX_BYTES // (4 * 8 * 2) + 1
    parts = [
        torch.randn(2, 4, 8, generator=g).half(),
        misaligned,  # lands at row 2: memmove offsets count rows
        torch.randn(4, 2, 8, generator=g).half().transpose(0, 1),  # (2, 4, 8), not contiguous
        torch.randn(1, 4, 8, generator=g),  # float32: converted
        torch.empty(0, 4, 8, dtype=torch.float16),
        torch.randn(1, 4, 8, generator=g).half(),
        torch.randn(big_rows, 4, 8, generator=g).half(),  # over the memmove limit
    ]
    before = [p.clone() for p in parts]
    out = concat(parts, torch.float16, pin=False)
    assert torch.equal(out, torch.cat([p.to(torch.float16) for p in before]))
    assert all(torch.equal(p, b) for p, b in zip(parts, before, strict=True))


@pytest.mark.gpu
def test_gpu_lone_small_requests_replay_cuda_graphs_with_the_usual_answers(monkeypatch):
    """A small request on an idle GPU server is answered at once by a replay of the CUDA graph
    captured for its shape (the first of a shape takes the usual path and asks for the capture):
    the replay's answer is bit for bit the usual path's, and right against float64 for data it
    was not captured with; the same requests sent together batch as usual and get the same
    answers; a burst of 16 on the idle server batches (at most its first replays); with room
    for 3 graphs, the older shapes' graphs are dropped for the later ones; a request over
    --graph-max-kib never replays."""
    from kernels.reference import reference_attention
    from service.core import graphs

    monkeypatch.setattr(graphs, "GRAPHS_PER_WORKER", 3)

    cases = [  # (B, Hq, Hkv, Nq, Nk, D, dtype, options)
        (1, 8, 8, 128, 128, 64, torch.float16, {}),
        (2, 8, 2, 17, 97, 40, torch.bfloat16, {"causal": True, "return_lse": True}),
        (1, 8, 1, 1, 1025, 128, torch.float16, {"kv_lengths": torch.tensor([1000], dtype=torch.int64)}),
        (1, 4, 4, 97, 97, 111, torch.float32, {"scale": 0.3, "layout": "bnhd"}),
        (1, 2, 1, 1, 17, 256, torch.float16, {"causal": True, "return_lse": True}),
        # score modifiers: their graph is not a plain one's, and each replay reads its own slopes
        (2, 4, 2, 33, 70, 64, torch.float16, {"causal": True, "window_size": (9, -1), "softcap": 20.0,
                                               "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
    ]

    def request(case, seed: int) -> AttentionRequest:
        b, hq, hkv, nq, nk, d, dtype, options = case
        q, k, v = qkv(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, seed=seed)
        options = dict(options)
        if options.get("layout") == "bnhd":  # sent as (B, N, H, D)
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            return AttentionRequest.from_layout(q, k, v, **options)
        return AttentionRequest(q=q, k=k, v=v, **options)

    def replays(engine) -> float:
        return engine.metrics_registry.get_sample_value("attnserve_inference_graph_exec_total", {"device": "cuda:0"})

    async def main():
        engine = Engine(load_settings(["--device", "cuda:0", "--warmup-shapes", "", "--max-queue-delay-ms", "20"]))
        await engine.start()
        try:
            out = []
            for case in cases:
                usual = await engine.attend(request(case, 0))  # no graph yet: the usual path, a capture after
                for _ in range(200):  # until the launcher has captured it
                    before = replays(engine)
                    again = await engine.attend(request(case, 0))
                    if replays(engine) == before + 1:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError(f"no graph replay for {case[:7]}")
                other = request(case, 1)  # other data, the same graph
                await asyncio.sleep(0.002)  # alone: not right behind the previous request
                n = replays(engine)
                lone = await engine.attend(other)
                assert replays(engine) == n + 1
                together = await asyncio.gather(*(engine.attend(request(case, s)) for s in (1, 2, 3, 1)))
                out.append((case, usual, again, other, lone, together))
            # a burst on an idle server batches: at most its first request replays a graph
            await asyncio.sleep(0.002)
            n, launches = replays(engine), engine.metrics.exec_count.labels("cuda:0")._value.get()
            burst = await asyncio.gather(*(engine.attend(request(cases[0], s)) for s in range(16)))
            burst_replays = replays(engine) - n
            burst_launches = engine.metrics.exec_count.labels("cuda:0")._value.get() - launches
            assert len(burst) == 16 and burst_replays <= 1 and burst_launches < 16, (burst_replays, burst_launches)
            await asyncio.sleep(0.002)
            n = replays(engine)
            await engine.attend(request(cases[1], 0))  # its graph made room for later shapes
            assert replays(engine) == n, "a dropped graph replayed"
            n = replays(engine)
            big = AttentionRequest(*qkv(b=1, hq=8, hkv=8, nq=1024, nk=1024, d=64, dtype=torch.float16))
            for _ in range(3):
                await engine.attend(big)  # 3 MiB of inputs, over the default 1024 KiB
                await asyncio.sleep(0.05)
            big_replays = replays(engine) - n
            return out, big_replays
        finally:
            await engine.drain()

    out, big_replays = asyncio.run(main())
    assert big_replays == 0
    for case, usual, again, other, lone, together in out:
        assert torch.equal(again.o, usual.o), case[:7]
        if usual.lse is not None:
            assert torch.equal(again.lse, usual.lse)
        assert again.o.shape == usual.o.shape == lone.o.shape
        scale = other.scale if other.scale is not None else other.q.shape[-1] ** -0.5
        ref, _ = reference_attention(
            *(t.double() for t in (other.q, other.k, other.v)), causal=other.causal, scale=scale,
            kv_lengths=other.kv_lengths, masks=other.spec.masks,
        )
        if other.layout == "bnhd":
            ref = ref.transpose(1, 2)
        tol = 2e-2 if other.q.dtype == torch.bfloat16 else 5e-3
        assert (lone.o.double() - ref).abs().max().item() < tol, case[:7]
        for res in (together[0], together[3]):  # seed 1 twice, batched with seeds 2 and 3
            assert torch.equal(res.o, lone.o), case[:7]
            if lone.lse is not None:
                assert torch.equal(res.lse, lone.lse)


def test_a_lone_session_step_queues_when_the_launch_lock_is_held_elsewhere():
    """A step that comes alone runs inline (``Worker.run_inline``), unless another worker's thread
    holds the launch lock (it may be compiling): then the loop does not wait for it; the step
    queues, runs once the lock is free, and has the bits of the inline answer."""
    from service.sessions.step import SessionStep

    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        worker, sessions = engine.workers[0], engine.sessions

        def inline():
            return engine.metrics.registry.get_sample_value("attnserve_session_inline_total", {"device": "cpu"})

        sid = sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"]
        twin = sessions.create(num_kv_heads=2, head_dim=16, dtype="float32")["session"]
        q, k, v = qkv(hq=4, hkv=2, nq=3, nk=3, d=16, seed=5)
        await asyncio.sleep(0.001)
        first = await sessions.step(SessionStep.single(sid, q, k, v))
        assert inline() == 1

        lock = threading.Lock()
        lock.acquire()  # another GPU worker's launcher, say, mid-launch
        worker._launch_lock = lambda: lock
        await asyncio.sleep(0.001)
        task = asyncio.ensure_future(sessions.step(SessionStep.single(twin, q, k, v)))
        await asyncio.sleep(0.05)
        assert not task.done() and inline() == 1  # queued: the launcher thread waits for the lock
        lock.release()
        second = await asyncio.wait_for(task, 10)
        assert inline() == 1
        assert torch.equal(first.o, second.o) and first.lengths == second.lengths == [3]
        await engine.drain()

    asyncio.run(main())


def test_a_long_cpu_step_does_not_run_on_the_event_loop(monkeypatch):
    """On the CPU an inline step computes on the event loop: a one-row step over many keys (past
    ``CPU_INLINE_MAX_MACS``, lowered here) goes to the launcher thread, so the loop keeps serving
    meanwhile; a short one still runs inline. Both answers equal the float64 reference."""
    from service.sessions import scheduler
    from service.sessions.step import SessionStep

    monkeypatch.setattr(scheduler, "CPU_INLINE_MAX_MACS", 2 * 8 * 64 * 100)

    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        sessions = engine.sessions

        def inline():
            return engine.metrics.registry.get_sample_value("attnserve_session_inline_total", {"device": "cpu"})

        hq, d = 8, 64
        context = scheduler.CPU_INLINE_MAX_MACS // (2 * hq * d) + 1  # one row over these keys passes the bound
        sid = sessions.create(num_kv_heads=2, head_dim=d, dtype="float32")["session"]
        q, k, v = qkv(hq=hq, hkv=2, nq=context, nk=context, d=d, seed=7)
        await sessions.step(SessionStep.single(sid, q[:, :, :-1], k[:, :, :-1], v[:, :, :-1]))  # queued: many rows
        short = sessions.create(num_kv_heads=2, head_dim=d, dtype="float32")["session"]
        for name, n, inlined in ((short, 1, 1), (sid, context, 0)):
            before = inline()
            await asyncio.sleep(0.001)  # alone
            res = await sessions.step(SessionStep.single(name, q[:, :, n - 1 : n], k[:, :, n - 1 : n],
                                                         v[:, :, n - 1 : n]))
            assert inline() - before == inlined, name
            ref = torch.softmax(q[:, :, n - 1 : n].double() @ k[:, :, :n].double().repeat_interleave(4, 1)
                                .transpose(-1, -2) * d ** -0.5, -1) @ v[:, :, :n].double().repeat_interleave(4, 1)
            torch.testing.assert_close(res.o.double(), ref, rtol=1e-5, atol=1e-5)
        await engine.drain()

    asyncio.run(main())


def test_a_step_whose_caller_went_away_while_staged_appends_nothing():
    """A step handed to its worker behind a running launch (staged) whose caller then goes away
    (a client hang-up cancels the awaiting task) appends nothing: it is skipped as expired, or
    undone had it run. It was launched and kept, counted as a success and a cancellation both."""
    from service.sessions.step import SessionStep

    async def main():
        engine = Engine(cpu_settings())
        await engine.start()
        sessions = engine.sessions
        scheduler = sessions.schedulers[0]
        busy = sessions.create(num_kv_heads=2, head_dim=64, dtype="float32")["session"]
        sid = sessions.create(num_kv_heads=2, head_dim=64, dtype="float32")["session"]
        big = asyncio.ensure_future(sessions.step(SessionStep.single(busy, *qkv(hq=8, nq=4096, nk=4096, d=64))))
        while scheduler.inflight < 1:
            await asyncio.sleep(0.001)
        step = asyncio.ensure_future(sessions.step(SessionStep.single(sid, *qkv(hq=8, nq=1, nk=1, d=64, seed=3))))
        deadline = time.monotonic() + 30
        while scheduler.inflight < 2 and time.monotonic() < deadline:  # staged behind the running launch
            await asyncio.sleep(0.001)
        assert scheduler.inflight == 2 and not big.done(), "the step was not staged behind the big one"
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        await big
        while sessions.held:  # the abandoned step finishes (skipped) on its own
            await asyncio.sleep(0.01)
        assert sessions.describe(sid)["lengths"] == [0]
        again = await sessions.step(SessionStep.single(sid, *qkv(hq=8, nq=1, nk=1, d=64, seed=4)))
        assert again.lengths == [1]
        await engine.drain()

    asyncio.run(main())


@pytest.mark.parametrize("options", [{}, {"softcap": 5.0, "window_size": (700, 700), "alibi": True},
                                     {"causal": True, "softcap": 5.0, "window_size": (64, 64), "alibi": True}],
                         ids=["plain", "modifiers", "causal-modifiers"])
def test_the_reference_kernels_memory_estimate_covers_its_peak(options):
    """The 413 check's estimate of ``kernel=reference`` (which materialises S) bounds the memory it
    takes: measured as the peak RSS of a fresh process with the server's allocator settings (a
    server's RSS once grew 1.3-2.0x past the estimate: the modifiers' and the masks' copies of S)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch
        from service.allocator import reuse_freed_memory
        from service.core.devices import attention_memory
        reuse_freed_memory(256 << 20)  # the server's allocator: glibc keeps freed blocks this big
        from service.core.types import AttentionRequest
        opts = {options!r}
        alibi = torch.rand(16) if opts.pop("alibi", False) else None
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 16, 1400, 1, generator=g).half() for _ in range(3))
        req = AttentionRequest(q=q, k=k, v=v, kernel="reference", alibi_slopes=alibi, **opts)
        need = attention_memory(req, "cpu")
        import kernels
        kernels.attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], kernel="reference")  # allocator warm
        def peak():  # this process's own high-water mark (ru_maxrss may keep the parent's, from before exec)
            return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
        before = peak()
        kernels.attention(q, k, v, kernel="reference", causal=req.causal, window_size=req.window_size,
                          softcap=req.softcap, alibi_slopes=alibi)
        print(need, peak() - before)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    need, grown = map(int, out.stdout.split())
    s_bytes = 4 * 16 * 1400 * 1400
    assert grown > 2 * s_bytes, "the case must exercise S-sized temporaries"
    assert grown <= need, f"the reference kernel grew by {grown / 2**20:.0f} MiB, estimated {need / 2**20:.0f} MiB"
