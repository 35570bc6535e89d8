"""Locust users for attnserve: every transport of docs/api.md, every answer checked.

    locust -f loadtest/locustfile.py -H http://HOST:8000 --mix small [--grpc-target HOST:8001] \
        SafetensorsUser GrpcUser JsonUser OipUser

Users (pick any on the command line; each has weight 1):
  SafetensorsUser  POST /attention, application/x-safetensors      (request names "st <shape>")
  JsonUser         POST /attention, application/json, small only:  "json-b64 small-f16" (base64 data)
                   and "json-list small-f32" (nested float32 lists)
  OipUser          POST /v2/models/attention/infer, binary tensor extension ("oip <shape>")
  GrpcUser         attention.v1.AttentionService/Attend             ("grpc <shape>", type "grpc")
  SessionUser      a session's life over HTTP (docs/api.md#sessions): create, a chunked prefill, decode steps,
                   the last with end=true ("session create|prefill|decode <plan>"); mixes
                   sessions and sessions-small (loadtest/sessions.py), every answer checked
                   against a client-side reference

Options (also from the environment): --mix small|prefill|decode|mixed|sessions|sessions-small
(LOADTEST_MIX), --grpc-target HOST:PORT (LOADTEST_GRPC_TARGET; default the HTTP host at port 8001),
--request-timeout seconds (LOADTEST_REQUEST_TIMEOUT), --api-key KEY (LOADTEST_API_KEY). Shapes of
each mix: loadtest/payloads.py, loadtest/sessions.py.
A wrong answer, a mixed-up answer, a wrong shape or dtype, and any non-200 status (429 backpressure
included) is a failure.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import gevent
import grpc
import locust.runners
import numpy as np
from locust import FastHttpUser, User, constant, events, task
from locust.runners import MasterRunner, WorkerRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `locust -f loadtest/locustfile.py`

from loadtest import encodings, payloads, sessions  # noqa: E402
from loadtest.payloads import WrongAnswer  # noqa: E402

# gRPC users call in native threads (gevent's thread pool), not through grpc's gevent mode: there,
# with many users per process sending ~100 MiB messages, building, sending and parsing hold the
# process's gevent loop for seconds, its heartbeats stop, and the master drops every worker
# ("failed to send heartbeat ... The last worker went missing, stopping test"; docs/loadtest.md).
# In threads the loop keeps running: grpc releases the GIL while it waits, and a big copy holds it
# for tens of milliseconds at most.
GRPC_THREADS = 1024  # at most this many calls at once per Locust process (one per gRPC user)
# A worker busy with big requests may still miss Locust's 3 s of heartbeats on a loaded host: the
# master waits 30 s before it drops a silent worker and stops the run.
locust.runners.HEARTBEAT_LIVENESS = 30

GRPC_MAX_MESSAGE = 1 << 30  # docs/api.md#grpc: at least 1 GiB each way


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--mix", choices=sorted(payloads.MIXES) + sorted(sessions.SESSION_MIXES),
                        env_var="LOADTEST_MIX", default="small",
                        help="request mix: loadtest/payloads.py (stateless), loadtest/sessions.py (sessions)")
    parser.add_argument("--grpc-target", env_var="LOADTEST_GRPC_TARGET", default="",
                        help="host:port of the gRPC server (default: the HTTP host, port 8001)")
    parser.add_argument("--request-timeout", type=float, env_var="LOADTEST_REQUEST_TIMEOUT", default=300.0,
                        help="seconds a request may take before it fails on the client")
    parser.add_argument("--final-stats", env_var="LOADTEST_FINAL_STATS", default="",
                        help="write the final statistics (after the users stopped) as JSON here")
    parser.add_argument("--api-key", env_var="LOADTEST_API_KEY", default="",
                        help="sent as 'Authorization: Bearer KEY' (HTTP header, gRPC metadata)")
    parser.add_argument("--session-prefix", env_var="LOADTEST_SESSION_PREFIX", default="",
                        help="session users name their sessions PREFIX + a random hex (default: the server names them)")


class _State:
    """Per-process: the prepared request pools (built once, at init, before any user starts)."""

    pools: dict[str, payloads.Pool] = {}
    stopped_at: float | None = None  # wall time the run stopped (test_stop), for the rates
    mix = "small"
    grpc_target = ""
    timeout = 300.0
    auth: dict[str, str] = {}
    session_prefix = ""  # session users' ids start with it, so the runner can find what a run left

    @classmethod
    def pool(cls, mix: str) -> payloads.Pool:
        if mix not in cls.pools:
            shapes = [payloads.JSON_LIST, payloads.SMALL] if mix == "json" else payloads.MIXES[mix]
            cls.pools[mix] = payloads.Pool(shapes, seed=os.getpid())
        return cls.pools[mix]


@events.init.add_listener
def _init(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None:  # used as a library without options: defaults
        return
    _State.mix, _State.timeout = opts.mix, opts.request_timeout
    _State.auth = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    _State.session_prefix = opts.session_prefix
    host = urlparse(environment.host or opts.host or "http://127.0.0.1:8000").hostname or "127.0.0.1"
    _State.grpc_target = opts.grpc_target or f"{host}:8001"
    if opts.final_stats and not isinstance(environment.runner, WorkerRunner):
        environment.events.test_stop.add_listener(lambda **_: setattr(_State, "stopped_at", time.time()))
        environment.events.quit.add_listener(lambda **_: _write_final_stats(environment, opts.final_stats))
    if isinstance(environment.runner, MasterRunner):
        return  # the master only aggregates statistics
    t0 = time.perf_counter()
    classes = {u.__name__ for u in environment.user_classes}
    if classes - {"JsonUser", "SessionUser"}:
        _State.pool(_State.mix)
    if "JsonUser" in classes:
        _State.pool("json")
    print(f"loadtest: prepared mix {_State.mix!r} in {time.perf_counter() - t0:.1f}s (pid {os.getpid()})",
          file=sys.stderr)


def _write_final_stats(environment, path: str, stopped_at: float | None = None) -> None:
    """Locust's CSV is written every second, so it misses the last requests; this runs at quit,
    after the users stopped (and, distributed, after the workers' last reports).

    Rates are over the measured window, from the statistics' start (the reset after the spawn)
    to the stop. Up to the last request instead would overstate them when answers stop coming: a
    30 s cell whose 21 answers all came in its first 2.4 s read 8.8 req/s, not 0.7."""
    stats = environment.runner.stats
    stopped_at = stopped_at or _State.stopped_at
    end = stopped_at if stopped_at and stopped_at > stats.total.start_time else stats.total.last_request_timestamp
    span = max(end - stats.total.start_time, 1e-9) if end else float("nan")

    def entry(e) -> dict:
        return {"type": e.method, "name": e.name, "requests": e.num_requests, "failures": e.num_failures,
                "rps": e.num_requests / span, "duration_s": span, "avg_ms": e.avg_response_time,
                "max_ms": e.max_response_time, "bytes": e.total_content_length,
                **{f"p{q}_ms": e.get_response_time_percentile(q / 100) if e.num_requests else float("nan")
                   for q in (50, 95, 99)}}

    doc = {"total": entry(stats.total), "entries": [entry(e) for e in stats.entries.values()],
           "errors": [{"name": e.name, "type": e.method, "error": str(e.error), "occurrences": e.occurrences}
                      for e in stats.errors.values()]}
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


class _HttpBase(FastHttpUser):
    abstract = True
    wait_time = constant(0)
    connection_timeout = 60.0

    def __init__(self, environment) -> None:
        self.network_timeout = _State.timeout  # read by FastHttpUser.__init__ when it builds the client
        super().__init__(environment)
        self.rng = random.Random()

    def _post(self, name: str, path: str, body: bytes, headers: dict[str, str], check) -> None:
        headers = {**headers, **_State.auth}
        with self.client.post(path, data=body, headers=headers, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                detail = resp.error if resp.status_code == 0 else (resp.text or "")[:300]
                resp.failure(f"HTTP {resp.status_code}: {detail}")
                return
            try:
                check(resp)
            except WrongAnswer as e:
                resp.failure(str(e))


class SafetensorsUser(_HttpBase):
    """POST /attention with a safetensors body; options as query parameters (docs/api.md#http-api)."""

    @task
    def attend(self) -> None:
        p = _State.pool(_State.mix).draw(self.rng)
        body, exp = encodings.safetensors_body(p, self.rng)
        path = "/attention?causal=true" if p.shape.causal else "/attention"
        self._post(f"st {p.shape.label}", path, body, {"Content-Type": "application/x-safetensors"},
                   lambda r: encodings.check_safetensors(r.content, exp))


class JsonUser(_HttpBase):
    """POST /attention with JSON: base64 float16 and nested-list float32 (small shapes only)."""

    @task
    def attend(self) -> None:
        p = _State.pool("json").draw(self.rng)
        if p.shape.dtype == "float32":
            name, (body, exp) = f"json-list {p.shape.label}", encodings.json_list_body(p, self.rng)
        else:
            name, (body, exp) = f"json-b64 {p.shape.label}", encodings.json_b64_body(p, self.rng)
        self._post(name, "/attention", body, {"Content-Type": "application/json"},
                   lambda r: encodings.check_json(r.content, exp))


class OipUser(_HttpBase):
    """Open Inference Protocol infer with the binary tensor data extension (docs/api.md#open-inference-protocol)."""

    @task
    def infer(self) -> None:
        p = _State.pool(_State.mix).draw(self.rng)
        body, headers, exp = encodings.oip_body(p, self.rng)
        def check(r):
            encodings.check_oip(r.content, r.headers.get("Inference-Header-Content-Length"), exp)
        self._post(f"oip {p.shape.label}", "/v2/models/attention/infer", body, headers, check)


class SessionUser(_HttpBase):
    """One session's whole life per task, over HTTP safetensors (docs/api.md#sessions); the plan is drawn
    from the session mix (--mix sessions, sessions-small), by weight. A user stopped mid-life ends
    its session in on_stop. With worker processes Locust's master interrupts its workers 3 s
    after the run ends, before their users' on_stop has run, so the runner (loadtest/run.py)
    names the sessions (--session-prefix) and ends what a run left."""

    sid: str | None = None  # the session this user holds now

    def on_stop(self) -> None:
        if self.sid is not None:
            sid, self.sid = self.sid, None
            with self.client.delete(f"/sessions/{sid}", name="session delete (user stopped)", headers=_State.auth,
                                    catch_response=True) as resp:
                if resp.status_code == 404:  # stopped after the step that ended it answered
                    resp.success()

    @task
    def live(self) -> None:
        plans = sessions.SESSION_MIXES.get(_State.mix) or sessions.SESSION_MIXES["sessions-small"]
        plan = self.rng.choices(plans, [p.weight for p in plans])[0]
        ref = sessions.SessionReference(plan, np.random.default_rng(self.rng.getrandbits(63)))
        auth = _State.auth
        doc = {"layers": plan.layers, "num_kv_heads": plan.hkv, "head_dim": plan.d, "dtype": plan.dtype}
        if _State.session_prefix:
            doc["session"] = f"{_State.session_prefix}{self.rng.getrandbits(64):016x}"
        with self.client.post("/sessions", name=f"session create {plan.label}", catch_response=True,
                              json=doc, headers=auth) as resp:
            if resp.status_code != 201:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:300]}")
                return
            sid = self.sid = resp.json()["session"]
        steps = plan.steps
        for i, n in enumerate(steps):
            phase = "decode" if i >= len(steps) - plan.decode else "prefill"
            for layer in range(plan.layers):
                last = i == len(steps) - 1 and layer == plan.layers - 1
                if not self._step(sid, ref, layer, n, phase, end=last):
                    self.sid = None
                    self.client.delete(f"/sessions/{sid}", name="session delete (after a failure)", headers=auth)
                    return
        self.sid = None  # the last step's end=true ended it

    def _step(self, sid: str, ref: sessions.SessionReference, layer: int, n: int, phase: str, end: bool) -> bool:
        t = ref.tensors(n)
        order = [(name, ref.plan.dtype, shape, len(raw)) for name, (shape, raw, _) in t.items()]
        body = encodings.safetensors_header(order) + b"".join(raw for _, raw, _ in t.values())
        path = f"/sessions/{sid}/attend?layer={layer}" + ("&end=true" if end else "")
        headers = {"Content-Type": "application/x-safetensors", **_State.auth}
        with self.client.post(path, data=body, headers=headers, name=f"session {phase} {ref.plan.label}",
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:300]}")
                return False
            ref.append(layer, t["k"][2], t["v"][2])
            try:
                out = encodings.parse_safetensors(resp.content)
                if "o" not in out:
                    raise WrongAnswer(f"response holds {sorted(out)}, no 'o'")
                dtype, shape, raw = out["o"]
                ref.check(layer, t["q"][2], raw, shape, dtype, self.rng.randrange(1 << 30))
            except WrongAnswer as e:
                resp.failure(str(e))
                return False
        return True


class GrpcUser(User):
    """attention.v1 Attend over its own HTTP/2 connection; reports as request type "grpc"."""

    wait_time = constant(0)

    def on_start(self) -> None:
        from service.grpc.protogen import attention_stubs  # generates proto/gen if stale

        stubs = attention_stubs()
        self.rng = random.Random()
        self.pb = stubs.attention_pb2
        self.channel = grpc.insecure_channel(_State.grpc_target, options=[
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
            ("grpc.use_local_subchannel_pool", 1),  # one connection per user, like the HTTP users
        ])
        # requests go as bytes serialized here (encodings.grpc_attend_body), answers parse as usual
        self.attend_rpc = self.channel.unary_unary(
            "/attention.v1.AttentionService/Attend", request_serializer=None,
            response_deserializer=self.pb.AttendResponse.FromString)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def attend(self) -> None:
        p = _State.pool(_State.mix).draw(self.rng)
        pool = gevent.get_hub().threadpool
        pool.maxsize = max(pool.maxsize, GRPC_THREADS)
        elapsed, length, exc = pool.apply(self._call, (p,))  # this greenlet waits; the others run
        self.environment.events.request.fire(
            request_type="grpc", name=f"grpc {p.shape.label}", response_time=elapsed * 1000.0,
            response_length=length, exception=exc, context={})

    def _call(self, p) -> tuple[float, int, Exception | None]:
        """In a native thread: one Attend, its answer checked -> (seconds, answer bytes, failure)."""
        req, exp = encodings.grpc_attend_body(p, self.rng, self.pb)
        start, length, exc = time.perf_counter(), 0, None
        try:
            resp = self.attend_rpc(req, timeout=_State.timeout, metadata=tuple(_State.auth.items()))
            elapsed = time.perf_counter() - start
            length = len(resp.o.data)
            exp.check_header(list(resp.o.shape), payloads.PB_TO_NAME.get(resp.o.dtype, str(resp.o.dtype)))
            exp.check_bits(resp.o.data)
        except grpc.RpcError as e:
            elapsed = time.perf_counter() - start
            exc = RuntimeError(f"gRPC {e.code().name}: {e.details()}")
        except WrongAnswer as e:
            exc = e
        return elapsed, length, exc
