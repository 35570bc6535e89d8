"""The load tests themselves: a short headless run of every user against a real CPU server with zero
failures, failures counted when the server refuses, and the answer check failing wrong answers."""

from __future__ import annotations

import contextlib
import json
import random
import struct
import subprocess
import sys

import httpx
import numpy as np
import pytest
from conftest import ROOT, run_server

sys.path.insert(0, str(ROOT))  # loadtest/ is not an installed package: plain `pytest` finds it too
from loadtest import payloads, run  # noqa: E402
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
    a run would fail, or count another run's users (H200 host, 2026-11-30)."""
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
    errors = " ".join(e["error"] for e in r["errors"])
    assert "401" in errors and "UNAUTHENTICATED" in errors, errors


# ---------------------------------------------------------------- the check fails wrong answers


def _attend(server, p: payloads.Prepared, rng) -> tuple[bytes, payloads.Expected]:
    body, exp = payloads.safetensors_body(p, rng)
    resp = httpx.post(server.url + "/attention", content=body, timeout=60,
                      headers={"Content-Type": "application/x-safetensors", "Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text
    return resp.content, exp


def _with_o(dtype: str, shape: list[int], raw: bytes) -> bytes:
    """A safetensors file holding only ``o`` = raw."""
    return payloads.safetensors_header([("o", dtype, shape, len(raw))]) + raw


# Odd sizes: D 59 (not a power of two), GQA 4/1, Nq 17 < Nk 97 with causal (bottom-right), bf16.
CHECK_SHAPES = [payloads.SMALL,
                payloads.Shape("odd-f16", 2, 4, 1, 17, 97, 59, "float16", causal=True),
                payloads.Shape("odd-bf16", 1, 4, 2, 33, 70, 40, "bfloat16", causal=True)]


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=lambda s: s.label)
def test_check_accepts_the_answer_and_fails_anything_else(server, shape):
    rng = random.Random(0)
    p = payloads.prepare(shape, seed=1)
    body, exp = _attend(server, p, rng)
    payloads.check_safetensors(body, exp)  # the right answer passes

    _, other = payloads.safetensors_body(p, rng)  # the same shape, another request's c
    with pytest.raises(WrongAnswer, match="mixed-up"):
        payloads.check_safetensors(body, other)

    dtype, oshape, raw = payloads.parse_safetensors(body)["o"]
    wrong_dtype = "bfloat16" if dtype == "float16" else "float16"
    with pytest.raises(WrongAnswer, match="expected"):
        payloads.check_safetensors(_with_o(wrong_dtype, oshape, bytes(raw)), exp)
    swapped = [oshape[0], oshape[2], oshape[1], oshape[3]]  # bnhd instead of bhnd
    with pytest.raises(WrongAnswer, match="expected"):
        payloads.check_safetensors(_with_o(dtype, swapped, bytes(raw)), exp)

    bits = np.frombuffer(raw, dtype=np.uint16).copy()
    row = shape.b * shape.hq * shape.nq // 2
    bits[row * shape.d + 3] = 0x7E00  # one NaN in the middle of the answer
    with pytest.raises(WrongAnswer):
        payloads.check_safetensors(_with_o(dtype, oshape, bits.tobytes()), exp)
    with pytest.raises(WrongAnswer):  # a truncated answer
        payloads.check_safetensors(_with_o(dtype, oshape, bytes(raw)[:-2]), exp)


def test_check_json_and_oip_fail_wrong_answers():
    rng = random.Random(3)
    p = payloads.prepare(payloads.JSON_LIST, seed=2)
    _, exp = payloads.json_list_body(p, rng)
    o = np.broadcast_to(exp.c, exp.shape)
    payloads.check_json(json.dumps({"o": o.tolist()}).encode(), exp)
    with pytest.raises(WrongAnswer):
        payloads.check_json(json.dumps({"o": (o * 1.01).tolist()}).encode(), exp)
    with pytest.raises(WrongAnswer):
        payloads.check_json(json.dumps({"o": o[:, :, :-1].tolist()}).encode(), exp)

    p16 = payloads.prepare(payloads.SMALL, seed=2)
    _, _, exp16 = payloads.oip_body(p16, rng)
    raw = np.broadcast_to(exp16.c.astype(np.float16), exp16.shape).tobytes()
    head = json.dumps({"outputs": [{"name": "o", "shape": exp16.shape, "datatype": "FP16",
                                    "parameters": {"binary_data_size": len(raw)}}]}).encode()
    payloads.check_oip(head + raw, str(len(head)), exp16)
    _, _, other = payloads.oip_body(p16, rng)
    with pytest.raises(WrongAnswer):
        payloads.check_oip(head + raw, str(len(head)), other)


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
    body = payloads.safetensors_header([("o", "float16", [2, 3], len(raw))]) + raw
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
    """A cell whose statistics cover much less than its run time (256 gRPC users of 96 MiB calls:
    the last 6.9 s of 140, H200 host, 2026-11-30) says so."""
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
    """The hand-appended v field (payloads.grpc_attend_body) parses to the AttendRequest that
    building it as a message gives, the second call (cached q, k) too."""
    from service.grpc.protogen import attention_stubs

    pb = attention_stubs().attention_pb2
    shape = payloads.SHAPES[label]
    p = payloads.prepare(shape, seed=3)
    for seed in (1, 2):
        body, exp = payloads.grpc_attend_body(p, random.Random(seed), pb)
        _, v = p.fresh_v(random.Random(seed))
        code = payloads.DTYPE_CODES[shape.dtype][2]
        want = pb.AttendRequest(q=pb.Tensor(shape=shape.q_shape, dtype=code, data=p.q),
                                k=pb.Tensor(shape=shape.kv_shape, dtype=code, data=p.k),
                                v=pb.Tensor(shape=shape.kv_shape, dtype=code, data=v), causal=shape.causal)
        assert pb.AttendRequest.FromString(body) == want
        assert exp.shape == shape.q_shape


def test_grpc_users_with_big_messages_keep_their_workers(tmp_path):
    """32 gRPC users in 2 Locust processes sending 32-128 MiB decode messages: every worker keeps
    heartbeating, so the statistics cover the whole run. Through grpc's gevent mode the calls held
    each process's gevent loop for seconds and the master dropped every worker within seconds (CPU
    box: "The last worker went missing, stopping test"; the H200 host's gRPC prefill cells at 256
    users lost all their users the same way, 2026-11-30)."""
    with run_server(tmp_path, "--warmup-shapes", "1x1x8x8",
                    "--request-timeout-ms", "600000") as server:
        cmd = [sys.executable, "-m", "loadtest.run", "--host", server.url, "--grpc-target", server.grpc_target,
               "--reports-dir", str(tmp_path), "--tag", "t", "--no-html", "--mix", "decode",
               "--user-class", "grpc", "--users", "32", "--run-time", "20s", "--processes", "2",
               "--stop-timeout", "2", "--locust-loglevel", "INFO"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "t_summary.json").read_text())
    assert "went missing" not in out, out[-3000:]
    assert summary["result"]["failures"] == 0, out[-3000:]
    assert summary["result"]["requests"] > 0 and summary["result"]["duration_s"] >= 15, out[-3000:]
