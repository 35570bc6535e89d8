"""The load tests themselves: a short headless run of every user against a real CPU server with zero
failures, failures counted when the server refuses, and the answer check failing wrong answers."""

from __future__ import annotations

import contextlib
import json
import random
import re
import struct
import subprocess
import sys

import httpx
import numpy as np
import pytest
from conftest import ROOT, run_server

sys.path.insert(0, str(ROOT))  # loadtest/ is not an installed package: plain `pytest` finds it too
from loadtest import encodings, payloads, run, sessions  # noqa: E402
from loadtest.payloads import WrongAnswer  # noqa: E402

KEY = "loadtest-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A CPU server that needs an API key (so a run without one fails every request)."""
    with run_server(tmp_path_factory.mktemp("server"), "--api-key", KEY, "--warmup-shapes", "1x1x8x8") as s:
        yield s


def loadtest(server, tmp_path, *args: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "loadtest.run", "--host", server.url, "--grpc-target", server.grpc_target,
           "--reports-dir", str(tmp_path), "--tag", "t", "--no-html", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "t_summary.json").read_text())
    return proc.returncode, summary, proc.stdout + proc.stderr


def test_smoke_every_user_zero_failures(server, tmp_path):
    rc, summary, out = loadtest(server, tmp_path, "--users", "4", "--run-time", "5s", "--mix", "small",
                                "--user-class", "st,json,oip,grpc", "--api-key", KEY,
                                "--sample-memory", str(server.proc.pid), "--sample-interval", "1")
    r = summary["result"]
    assert rc == 0, out
    assert r["failures"] == 0 and r["requests"] > 0, out
    names = {e["name"] for e in r["per_name"] if e["requests"] > 0}
    assert names == {"st small-f16", "json-b64 small-f16", "json-list small-f32", "oip small-f16",
                     "grpc small-f16"}, out
    assert r["tflops"] > 0 and r["q_tokens_per_s"] > 0
    batches = summary["batch_sizes"]
    assert batches is None or batches["launches"] > 0, out
    assert summary["memory"] and summary["memory"][0]["samples"] >= 3
    assert (tmp_path / "t_memory.csv").read_text().startswith("time_s,source,metric,value")
    assert "throughput:" in out and "failures: 0 of" in out

    # the run's summary -> table and plots; the table alone -> the same table and plots again
    from loadtest import report

    report.main([str(tmp_path), "--out", str(tmp_path / "rep")])
    table = (tmp_path / "rep" / "results.md").read_text()
    assert "| small | st+json+oip+grpc |" in table and (tmp_path / "rep" / "small_throughput.png").stat().st_size
    assert (tmp_path / "rep" / "t_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the RSS series
    report.main(["--from-csv", str(tmp_path / "rep" / "results.csv"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "results.md").read_text() == table
    assert (tmp_path / "again" / "small_p99.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worker_processes_meet_only_their_own_master(server, tmp_path):
    """With --processes, a run's Locust workers talk to its master on a port of its own: on Locust's
    default port (5557, held here by another listener, as by a previous run's master or workers)
    a run would fail, or count another run's users."""
    import socket

    with contextlib.ExitStack() as stack:
        squatter = stack.enter_context(socket.socket())
        with contextlib.suppress(OSError):  # already taken on this machine: it is held anyway
            squatter.bind(("0.0.0.0", 5557))
            squatter.listen()
        rc, summary, out = loadtest(server, tmp_path, "--users", "2", "--run-time", "4s", "--mix", "small",
                                    "--user-class", "st", "--api-key", KEY, "--processes", "2")
    r = summary["result"]
    assert rc == 0, out
    assert r["failures"] == 0 and r["requests"] > 0, out


def test_refused_requests_are_failures(server, tmp_path):
    rc, summary, out = loadtest(server, tmp_path, "--users", "2", "--run-time", "2s",
                                "--user-class", "st,grpc", "--no-metrics")
    r = summary["result"]
    assert rc == 1, out
    assert r["requests"] > 0 and r["failures"] == r["requests"], out
    assert r["ok_rps"] == 0 and "throughput: 0.0 req/s" in out, out  # no answer: no throughput
    errors = " ".join(e["error"] for e in r["errors"])
    assert "401" in errors and "UNAUTHENTICATED" in errors, errors


# ---------------------------------------------------------------- the check fails wrong answers


def _attend(server, p: payloads.Prepared, rng) -> tuple[bytes, payloads.Expected]:
    body, exp = encodings.safetensors_body(p, rng)
    resp = httpx.post(server.url + "/attention", content=body, timeout=60,
                      headers={"Content-Type": "application/x-safetensors", "Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text
    return resp.content, exp


def _with_o(dtype: str, shape: list[int], raw: bytes) -> bytes:
    """A safetensors file holding only ``o`` = raw."""
    return encodings.safetensors_header([("o", dtype, shape, len(raw))]) + raw


# Odd sizes: D 59 (not a power of two), GQA 4/1, Nq 17 < Nk 97 with causal (bottom-right), bf16.
CHECK_SHAPES = [payloads.SMALL,
                payloads.Shape("odd-f16", 2, 4, 1, 17, 97, 59, "float16", causal=True),
                payloads.Shape("odd-bf16", 1, 4, 2, 33, 70, 40, "bfloat16", causal=True)]


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=lambda s: s.label)
def test_check_accepts_the_answer_and_fails_anything_else(server, shape):
    rng = random.Random(0)
    p = payloads.prepare(shape, seed=1)
    body, exp = _attend(server, p, rng)
    encodings.check_safetensors(body, exp)  # the right answer passes

    _, other = encodings.safetensors_body(p, rng)  # the same shape, another request's c
    with pytest.raises(WrongAnswer, match="mixed-up"):
        encodings.check_safetensors(body, other)

    dtype, oshape, raw = encodings.parse_safetensors(body)["o"]
    wrong_dtype = "bfloat16" if dtype == "float16" else "float16"
    with pytest.raises(WrongAnswer, match="expected"):
        encodings.check_safetensors(_with_o(wrong_dtype, oshape, bytes(raw)), exp)
    swapped = [oshape[0], oshape[2], oshape[1], oshape[3]]  # bnhd instead of bhnd
    with pytest.raises(WrongAnswer, match="expected"):
        encodings.check_safetensors(_with_o(dtype, swapped, bytes(raw)), exp)

    bits = np.frombuffer(raw, dtype=np.uint16).copy()
    row = shape.b * shape.hq * shape.nq // 2
    bits[row * shape.d + 3] = 0x7E00  # one NaN in the middle of the answer
    with pytest.raises(WrongAnswer):
        encodings.check_safetensors(_with_o(dtype, oshape, bits.tobytes()), exp)
    with pytest.raises(WrongAnswer):  # a truncated answer
        encodings.check_safetensors(_with_o(dtype, oshape, bytes(raw)[:-2]), exp)


def test_check_json_and_oip_fail_wrong_answers():
    rng = random.Random(3)
    p = payloads.prepare(payloads.JSON_LIST, seed=2)
    _, exp = encodings.json_list_body(p, rng)
    o = np.broadcast_to(exp.c, exp.shape)
    encodings.check_json(json.dumps({"o": o.tolist()}).encode(), exp)
    with pytest.raises(WrongAnswer):
        encodings.check_json(json.dumps({"o": (o * 1.01).tolist()}).encode(), exp)
    with pytest.raises(WrongAnswer):
        encodings.check_json(json.dumps({"o": o[:, :, :-1].tolist()}).encode(), exp)

    p16 = payloads.prepare(payloads.SMALL, seed=2)
    _, _, exp16 = encodings.oip_body(p16, rng)
    raw = np.broadcast_to(exp16.c.astype(np.float16), exp16.shape).tobytes()
    head = json.dumps({"outputs": [{"name": "o", "shape": exp16.shape, "datatype": "FP16",
                                    "parameters": {"binary_data_size": len(raw)}}]}).encode()
    encodings.check_oip(head + raw, str(len(head)), exp16)
    _, _, other = encodings.oip_body(p16, rng)
    with pytest.raises(WrongAnswer):
        encodings.check_oip(head + raw, str(len(head)), other)


def test_check_samples_big_answers_and_still_catches_a_mix_up():
    shape = payloads.Shape("big", 1, 8, 8, 1 << 16, 1, 16, "float16")  # 8M values > CHECK_LIMIT
    rng = random.Random(4)
    exp = payloads.Expected(shape.q_shape, "float16", payloads.random_c(rng, 16, "float16")[0])
    other = payloads.Expected(shape.q_shape, "float16", payloads.random_c(rng, 16, "float16")[0])
    raw = np.broadcast_to(exp.c.astype(np.float16), exp.shape).tobytes()
    exp.check_bits(raw)
    with pytest.raises(WrongAnswer):
        other.check_bits(raw)


# ---------------------------------------------------------------- what the summary derives


def test_flops_count_causal_pairs_bottom_right():
    s = payloads.Shape("c", 1, 1, 1, 17, 97, 8, "float16", causal=True)
    brute = sum(1 for i in range(17) for j in range(97) if j <= i + 97 - 17)
    assert s.pairs == brute
    assert payloads.SMALL.flops == 4 * 12 * 128 * 128 * 64
    assert payloads.PREFILL[0].pairs == 4096 * 4097 // 2


def test_batch_sizes_from_metric_deltas():
    name = "attnserve_inference_batch_size"
    before = {f'{name}_bucket{{device="cpu",le="1.0"}}': 10, f'{name}_bucket{{device="cpu",le="4.0"}}': 10,
              f'{name}_bucket{{device="cpu",le="+Inf"}}': 10, f'{name}_count{{device="cpu"}}': 10,
              f'{name}_sum{{device="cpu"}}': 10}
    after = {f'{name}_bucket{{device="cpu",le="1.0"}}': 12, f'{name}_bucket{{device="cpu",le="4.0"}}': 15,
             f'{name}_bucket{{device="cpu",le="+Inf"}}': 15, f'{name}_count{{device="cpu"}}': 15,
             f'{name}_sum{{device="cpu"}}': 24}
    b = run.batch_sizes(before, after)
    assert b["launches"] == 5 and b["mean"] == pytest.approx(14 / 5)
    assert b["launches_by_size_le"] == {"1": 2, "4": 3}
    assert run.batch_sizes(before, {"other_metric": 1.0}) is None


def test_safetensors_header_is_what_the_library_reads():
    from safetensors.numpy import load

    raw = np.arange(6, dtype=np.float16).tobytes()
    body = encodings.safetensors_header([("o", "float16", [2, 3], len(raw))]) + raw
    assert struct.unpack_from("<Q", body)[0] % 8 == 0
    np.testing.assert_array_equal(load(body)["o"], np.arange(6, dtype=np.float16).reshape(2, 3))


def test_docs_name_only_real_options():
    import re

    text = (ROOT / "docs" / "loadtest.md").read_text()
    documented = set(re.findall(r"^\| `(--[a-z-]+)", text, flags=re.M))
    known = {o for a in run.build_parser()._actions for o in a.option_strings}
    assert documented and documented <= known, documented - known


def test_final_rates_count_the_whole_window_not_up_to_the_last_answer(tmp_path):
    """A cell whose answers stop early (a queue longer than the cell) must not read as a high rate:
    the rate is requests over the measured window (statistics start -> test stop). Locust is
    imported in a child process: it monkey-patches the standard library with gevent."""
    script = f"""
import json, time
from locust.env import Environment
from loadtest import locustfile
env = Environment()
env.create_local_runner()
stats = env.runner.stats
t0 = time.time()
stats.total.start_time = t0 - 30.0          # a 30 s window ...
for _ in range(21):                          # ... whose 21 answers came in its first 2.4 s
    stats.log_request("POST", "st prefill", 5000, 10)
stats.total.last_request_timestamp = t0 - 27.6
locustfile._write_final_stats(env, {str(tmp_path / "final.json")!r}, stopped_at=t0)
locustfile._write_final_stats(env, {str(tmp_path / "no_stop.json")!r})
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    total = json.loads((tmp_path / "final.json").read_text())["total"]
    assert total["requests"] == 21 and total["rps"] == pytest.approx(0.7, rel=0.01)
    no_stop = json.loads((tmp_path / "no_stop.json").read_text())["total"]  # no test_stop seen: up to the last answer
    assert no_stop["rps"] == pytest.approx(21 / 2.4, rel=0.01)


def test_a_short_statistics_window_is_flagged():
    """A cell whose statistics cover much less than its run time (here the last 6.9 s of 140, as
    with hundreds of gRPC users of 96 MiB calls on a busy load generator) says so."""
    import io

    assert run.run_seconds("140s") == 140 and run.run_seconds("5m") == 300
    assert run.run_seconds("1h30m") == 5400 and run.run_seconds("90") == 90
    with pytest.raises(ValueError):
        run.run_seconds("soon")

    def printed(window_s: float) -> str:
        out = io.StringIO()
        result = {"requests": 44, "failures": 0, "rps": 44 / window_s, "p50_ms": 1.0, "p95_ms": 1.0, "p99_ms": 1.0,
                  "duration_s": window_s, "tflops": 0.0, "q_tokens_per_s": 0.0, "kv_tokens_per_s": 0.0,
                  "per_name": [], "errors": []}
        config = {"tag": "t", "users": 256, "mix": "prefill", "user_classes": ["grpc"], "processes": 4,
                  "run_time": "140s"}
        run.print_summary({"config": config, "result": result, "batch_sizes": None}, out=out)
        return out.getvalue()

    assert "only the last 6.9 s of the 140 s run" in printed(6.9)
    assert "NOTE" not in printed(139.5)


@pytest.mark.parametrize("label", ["small-f16", "decode-8k-bf16"])
def test_grpc_body_is_the_request_built_as_a_message(label):
    """The hand-appended v field (encodings.grpc_attend_body) parses to the AttendRequest that
    building it as a message gives, the second call (cached q, k) too."""
    from service.grpc.protogen import attention_stubs

    pb = attention_stubs().attention_pb2
    shape = payloads.SHAPES[label]
    p = payloads.prepare(shape, seed=3)
    for seed in (1, 2):
        body, exp = encodings.grpc_attend_body(p, random.Random(seed), pb)
        _, v = p.fresh_v(random.Random(seed))
        code = payloads.DTYPE_CODES[shape.dtype][2]
        want = pb.AttendRequest(q=pb.Tensor(shape=shape.q_shape, dtype=code, data=p.q),
                                k=pb.Tensor(shape=shape.kv_shape, dtype=code, data=p.k),
                                v=pb.Tensor(shape=shape.kv_shape, dtype=code, data=v), causal=shape.causal)
        assert pb.AttendRequest.FromString(body) == want
        assert exp.shape == shape.q_shape


def test_grpc_users_with_big_messages_keep_their_workers(tmp_path):
    """12 gRPC users in 2 Locust processes sending 32-128 MiB decode messages: every worker keeps
    heartbeating, so the statistics cover the whole run. Through grpc's gevent mode the calls hold
    each process's gevent loop for seconds and the master drops every worker within seconds ("The
    last worker went missing, stopping test"). More users would not test more: the CPU server
    shares two cores among every call in flight, and with 32 of them the first answers can take
    the whole run."""
    with run_server(tmp_path, "--warmup-shapes", "1x1x8x8",
                    "--request-timeout-ms", "600000") as server:
        cmd = [sys.executable, "-m", "loadtest.run", "--host", server.url, "--grpc-target", server.grpc_target,
               "--reports-dir", str(tmp_path), "--tag", "t", "--no-html", "--mix", "decode",
               "--user-class", "grpc", "--users", "12", "--run-time", "20s", "--processes", "2",
               "--stop-timeout", "2", "--locust-loglevel", "INFO"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "t_summary.json").read_text())
    assert "went missing" not in out, out[-3000:]
    assert summary["result"]["failures"] == 0, out[-3000:]
    assert summary["result"]["requests"] > 0 and summary["result"]["duration_s"] >= 15, out[-3000:]


STUB_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
case "$1 $2" in
  "-m service") exec sleep 120 ;;
esac
exit 0
"""


def test_gpu_script_runs_every_part_with_arguments_the_tools_take(tmp_path):
    """bench/gpu.sh all, with an interpreter that only records its calls: every part's tests and
    benchmarks run, into OUTDIR, each load-test run with arguments loadtest.run accepts, and the
    server is stopped at the end. An unknown part is a usage error."""
    import argparse
    import os
    import re
    import shutil

    script = ROOT / "bench" / "gpu.sh"
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    calls, out = tmp_path / "calls.txt", tmp_path / "out"
    env = {**os.environ, "PYTHON": str(stub), "CALLS": str(calls), "USERS": "16",
           "MIXES": "small prefill", "TRANSPORTS": "st grpc", "SOAK_S": "1", "IDLE_S": "0", "SOAK_CELLS": "1",
           "SESSION_S": "1"}
    proc = subprocess.run(["bash", str(script), "all", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = calls.read_text().splitlines()
    for want in ("-m pytest -q -m gpu", f"-m bench.kernels --out-dir {out}/kernels --budget-s 480",
                 "-m bench.service engine --only small,large,multi,procs --seconds 2",
                 "-m bench.http_latency --iters 150 --large-iters 4", "-m bench.grpc_latency --iters 500",
                 "-m bench.grpc_floor --iters 500", "-m bench.sessions --iters 100",
                 "-m service --host 127.0.0.1", f"-m loadtest.report {out}/loadtest/cells",
                 f"-m loadtest.report {out}/soak/cells"):
        assert any(line.startswith(want) for line in lines), (want, lines)
    runs = [line.split()[2:] for line in lines if line.startswith("-m loadtest.run ")]
    # 2 mixes x 2 transports x 1 user count, batching off and on; the soak, the sessions, then the
    # soak's cells (batching on)
    assert len(runs) == 2 * 2 * 2 + 1 + 1 + 2 * 2, runs
    assert any(args[args.index("--mix") + 1] == "sessions" for args in runs)
    for args in runs:
        run.build_parser().parse_args(args)
    from bench import http_latency

    http_args = argparse.ArgumentParser()
    http_latency.add_arguments(http_args)
    http_args.parse_args(next(line for line in lines if line.startswith("-m bench.http_latency ")).split()[2:])
    assert sum("--sample-memory" in a for a in runs) == 2
    assert (out / "env.txt").exists() and (out / "loadtest" / "bench.log").exists()
    assert (out / "soak" / "server_batching_on.log").exists()
    assert "-m service --host 127.0.0.1 --http-port 8000 --grpc-port 8001 --device cuda --no-batching" in lines
    text = script.read_text()
    assert ".whl" not in text and "-m pip" not in text and not re.search(r"\$\{?OUT\b", text)

    bad = subprocess.run(["bash", str(script), "bogus"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout


# ---------------------------------------------------------------- sessions


def test_session_users_live_whole_sessions_with_zero_failures(server, tmp_path):
    """--mix sessions-small (the session user by default): create, chunked prefill, decode, end;
    every answer checked against the users' own reference; no session is left behind."""
    rc, summary, out = loadtest(server, tmp_path, "--users", "3", "--run-time", "5s", "--mix", "sessions-small",
                                "--api-key", KEY)
    r = summary["result"]
    assert rc == 0, out
    assert r["failures"] == 0 and r["requests"] > 0, out
    phases = {e["name"].split(" ")[1] for e in r["per_name"] if e["requests"] > 0}
    assert phases == {"create", "prefill", "decode"}, out
    assert summary["config"]["user_classes"] == ["session"]
    assert summary["batch_sizes"] is None or summary["batch_sizes"]["launches"] > 0
    held = httpx.get(server.url + "/sessions", headers={"authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert held["count"] == 0 and held["kv_bytes_used"] == 0, held


def test_session_users_stopped_mid_session_end_their_sessions(server, tmp_path):
    """--stop-timeout 0 stops the users in the middle of their sessions: on_stop deletes each one."""
    rc, summary, out = loadtest(server, tmp_path, "--users", "4", "--run-time", "3s", "--mix", "sessions-small",
                                "--stop-timeout", "0", "--api-key", KEY)
    assert rc == 0 and summary["result"]["failures"] == 0, out
    held = httpx.get(server.url + "/sessions", headers={"authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert held["count"] == 0 and held["kv_bytes_used"] == 0, held


def test_session_users_of_worker_processes_leave_no_session(server, tmp_path):
    """With worker processes Locust's master interrupts its workers 3 s after the run, before their
    users' on_stop has run: the users name their sessions with the run's prefix and the runner
    ends what they left; sessions it did not name (another client's) stay."""
    auth = {"authorization": f"Bearer {KEY}"}
    other = httpx.post(server.url + "/sessions", json={"layers": 1, "num_kv_heads": 2, "head_dim": 16,
                                                       "dtype": "float32", "session": "another-client"},
                       headers=auth, timeout=10)
    assert other.status_code == 201, other.text
    try:
        rc, summary, out = loadtest(server, tmp_path, "--users", "4", "--run-time", "4s", "--mix", "sessions-small",
                                    "--processes", "2", "--stop-timeout", "5", "--api-key", KEY)
        assert rc == 0 and summary["result"]["failures"] == 0, out
        assert isinstance(summary["sessions_left"], int), summary["sessions_left"]
        held = httpx.get(server.url + "/sessions", headers=auth, timeout=10).json()
        assert held["sessions"] == ["another-client"], held
    finally:
        httpx.delete(server.url + "/sessions/another-client", headers=auth, timeout=10)


def test_session_mix_and_user_class_must_match(tmp_path):
    for args in (["--mix", "sessions", "--user-class", "st"], ["--mix", "small", "--user-class", "session"]):
        with pytest.raises(SystemExit, match="is for --user-class"):
            run.main(["--host", "http://127.0.0.1:9", "--reports-dir", str(tmp_path), *args])


@pytest.mark.parametrize(("args", "words"), [
    (["--users", "-3"], "--users must be at least 1"),
    (["--run-time", "xyz"], "--run-time: run time 'xyz'"),
    (["--users", "2", "--user-class", "st,grpc,oip"], "fewer than the 3 user classes"),  # one class would get none
])
def test_values_locust_would_take_badly_are_refused_first(tmp_path, args, words):
    with pytest.raises(SystemExit, match=re.escape(words)):
        run.main(["--host", "http://127.0.0.1:9", "--reports-dir", str(tmp_path), *args])


def _served(ref, layer: int, q: np.ndarray) -> np.ndarray:
    """What the server answers for a step of q on ``layer`` after its append (float64, as the dtype)."""
    import torch

    from kernels.reference import reference_attention

    p = ref.plan
    k = torch.from_numpy(ref.k[layer]).permute(1, 0, 2)[None].double()
    v = torch.from_numpy(ref.v[layer]).permute(1, 0, 2)[None].double()
    o, _ = reference_attention(torch.from_numpy(q).double(), k, v, causal=True, scale=p.d ** -0.5)
    return o.numpy().astype(np.float32)


@pytest.mark.parametrize("plan", [p.label for p in sessions.SESSION_MIXES["sessions-small"]])
def test_session_reference_accepts_the_answer_and_fails_anything_else(plan):
    """The right answer passes at the dtype's rounding; the answer over the keys before the step's
    append, another session's answer, a NaN, and a wrong shape all fail."""
    p = next(x for x in sessions.SESSION_MIXES["sessions-small"] if x.label == plan)
    ref = sessions.SessionReference(p, np.random.default_rng(0))
    other = sessions.SessionReference(p, np.random.default_rng(1))

    def raw(o: np.ndarray) -> bytes:
        return payloads._to_bits(o, p.dtype).tobytes()

    for i, n in enumerate(p.steps[:4]):
        t, u = ref.tensors(n), other.tensors(n)
        stale = _served(ref, 0, t["q"][2]) if ref.length(0) else None
        ref.append(0, t["k"][2], t["v"][2])
        other.append(0, u["k"][2], u["v"][2])
        shape = [1, p.hq, n, p.d]
        right = _served(ref, 0, t["q"][2])
        ref.check(0, t["q"][2], raw(right), shape, p.dtype, row_pick=i)
        bad = [_served(other, 0, u["q"][2]), np.full_like(right, np.nan)]
        if stale is not None and n == 1:
            bad.append(stale)
        for o in bad:
            with pytest.raises(WrongAnswer):
                ref.check(0, t["q"][2], raw(o), shape, p.dtype, row_pick=i)
        with pytest.raises(WrongAnswer):
            ref.check(0, t["q"][2], raw(right), [1, p.hq, n + 1, p.d], p.dtype, row_pick=i)


def test_session_benchmark_prints_every_table_on_the_cpu():
    """bench/sessions.py end to end on a CPU server of its own (tiny sizes): the step rows over
    HTTP and gRPC, the HTTP steps' server phases (single and packed), the packed row and the decode-loop row, with
    numbers in them."""
    cmd = [sys.executable, "-m", "bench.sessions", "--device", "cpu", "--contexts", "32", "--iters", "3",
           "--packed", "2", "--loop-sessions", "2", "--loop-layers", "2", "--loop-context", "8", "--loop-tokens", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4, proc.stdout
    step, phases, packed, loop = (r.strip("|").split("|") for r in rows)
    assert step[0].strip() == "32" and float(step[2]) > 0 and float(step[4]) > 0  # HTTP and gRPC p50
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| context | read |"))
    names = [c.strip() for c in header.strip("|").split("|")]
    assert {"read", "decode", "queue", "stage", "launch", "device", "return", "encode", "outside"} <= set(names)
    assert phases[0].strip() == "32" and all(float(x) >= 0 for x in phases[1:-1])
    packed_phases = next(line for line in proc.stdout.splitlines() if line.startswith("| packed 2 |"))
    assert all(float(x) >= 0 for x in packed_phases.strip("|").split("|")[1:-1])
    assert packed[0].strip() == "2" and float(packed[2]) > 0
    assert loop[:3] == [" 2 ", " 2 ", " 8 "] and float(loop[3]) > 0  # tokens/s
