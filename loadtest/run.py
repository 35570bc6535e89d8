"""Headless load test: run Locust on loadtest/locustfile.py, then print what the run measured.

    python -m loadtest.run --host http://127.0.0.1:8000 --users 64 --run-time 60s --mix small \
        --user-class st,grpc [--grpc-target 127.0.0.1:8001] [--processes 4] [--sample-memory PID]
    bash bench/gpu.sh loadtest      # a server on this GPU host and the whole matrix of runs (or: soak)

Writes to --reports-dir (default reports/): <tag>_stats.csv, _stats_history.csv, _failures.csv,
_exceptions.csv and <tag>.html (Locust's), <tag>_final.json (every request, counted after the users
stopped: what the summary is computed from), <tag>_summary.json (what is printed), and with
--sample-memory <tag>_memory.csv. Prints requests/s, latency percentiles, failures, the attention
throughput the successful requests carried (TFLOP/s, query and key tokens/s, from the shapes of
the mix), the server's batch sizes over the run (its /metrics histograms named *batch_size*) and,
when sampled, whether memory stayed flat. Exits 1 when any request failed or was answered wrongly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

from loadtest import payloads, sessions
from loadtest.observe import MemorySampler, scrape

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
USER_CLASSES = {"st": "SafetensorsUser", "json": "JsonUser", "oip": "OipUser", "grpc": "GrpcUser",
                "session": "SessionUser"}


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- Prometheus text


_SERIES = re.compile(r"^([^{]+)(?:\{(.*)\})?$")


def batch_sizes(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Requests per launch over the run, from the histograms whose name holds "batch_size"
    (summed over their labels): launches, mean, and the launches per bucket ("<= le")."""
    if not after:
        return None
    before = before or {}
    count = total = 0.0
    buckets: dict[float, float] = {}
    names = set()
    for key, value in after.items():
        m = _SERIES.match(key)
        if not m or "batch_size" not in m.group(1):
            continue
        name, labels = m.group(1), m.group(2) or ""
        delta = value - before.get(key, 0.0)
        if name.endswith("_count"):
            count += delta
            names.add(name[:-6])
        elif name.endswith("_sum"):
            total += delta
        elif name.endswith("_bucket"):
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                bound = float(le.group(1))
                buckets[bound] = buckets.get(bound, 0.0) + delta
    if not names:
        return None
    per_bucket, prev = {}, 0.0
    for bound in sorted(buckets):  # cumulative -> per bucket
        per_bucket["+Inf" if math.isinf(bound) else f"{bound:g}"] = buckets[bound] - prev
        prev = buckets[bound]
    return {"histograms": sorted(names), "launches": count, "requests": total,
            "mean": total / count if count else None,
            "launches_by_size_le": {k: v for k, v in per_bucket.items() if v}}


# ---------------------------------------------------------------- Locust's final statistics -> summary


def summarize(final_stats: Path) -> dict:
    """The locustfile's final statistics (--final-stats JSON) -> totals, per-request-name rows, and
    the attention throughput the successful requests carried (names end in a shape label)."""
    doc = json.loads(final_stats.read_text())
    total = doc["total"]
    if not total["requests"]:
        return {"requests": 0, "failures": 0, "rps": 0.0, "ok_rps": 0.0, "per_name": [], "errors": doc["errors"]}
    duration = total["duration_s"]
    flops = q_tok = kv_tok = 0.0
    for e in doc["entries"]:
        ok = e["requests"] - e["failures"]
        shape = payloads.SHAPES.get(payloads.label_of(e["name"]))
        if shape is not None:
            flops += ok * shape.flops
            q_tok += ok * shape.q_tokens
            kv_tok += ok * shape.kv_tokens
    keys = ("requests", "failures", "rps", "p50_ms", "p95_ms", "p99_ms", "max_ms")
    return {
        **{k: total[k] for k in keys}, "duration_s": duration,
        "ok_rps": (total["requests"] - total["failures"]) / duration,  # ("rps" counts failures too, as Locust's)
        "tflops": flops / duration / 1e12,
        "q_tokens_per_s": q_tok / duration, "kv_tokens_per_s": kv_tok / duration,
        "per_name": [{"type": e["type"], "name": e["name"], **{k: e[k] for k in keys}}
                     for e in sorted(doc["entries"], key=lambda e: e["name"])],
        "errors": doc["errors"],
    }


def run_seconds(run_time: str) -> float:
    """Locust's --run-time ("90", "140s", "5m", "1h30m") in seconds."""
    total, number = 0.0, ""
    for ch in run_time.strip().lower():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in "hms" and number:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
        else:
            raise ValueError(f"run time {run_time!r}: use e.g. 30s, 5m, 1h30m")
    return total + (float(number) if number else 0.0)


def end_sessions(host: str, prefix: str, api_key: str) -> int | str:
    """DELETE the sessions whose ids start with ``prefix`` (the ones this run's users named and
    did not end: users a worker process lost mid-session) -> how many, or why it could not look."""
    import urllib.error
    import urllib.request

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        req = urllib.request.Request(host + "/sessions", headers=headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            held = json.load(r).get("sessions", [])
        ended = 0
        for sid in held:
            if isinstance(sid, str) and sid.startswith(prefix):
                req = urllib.request.Request(f"{host}/sessions/{sid}", method="DELETE", headers=headers)
                with contextlib.suppress(urllib.error.HTTPError):  # 404: it ended meanwhile
                    urllib.request.urlopen(req, timeout=30).close()
                    ended += 1
        return ended
    except (OSError, ValueError) as exc:
        return f"could not list the sessions: {exc}"


def print_summary(s: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)
    c = s["config"]
    p(f"\n== {c['tag']}: {c['users']} users, mix {c['mix']}, {'+'.join(c['user_classes'])}, "
      f"{c['processes']} process(es), {c['run_time']} ==")
    r = s["result"]
    if not r["requests"]:
        p("no requests completed")
        return
    p(f"{'name':32} {'reqs':>8} {'fails':>6} {'req/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")
    for n in r["per_name"] + [{**r, "name": "Aggregated"}]:
        p(f"{n['name'][:32]:32} {n['requests']:>8} {n['failures']:>6} {n['rps']:>9.2f} "
          f"{n['p50_ms']:>8.0f} {n['p95_ms']:>8.0f} {n['p99_ms']:>8.0f}")
    p(f"throughput: {r.get('ok_rps', r['rps']):.1f} req/s, {r['tflops']:.3f} TFLOP/s, "
      f"{r['q_tokens_per_s']:,.0f} query tokens/s, {r['kv_tokens_per_s']:,.0f} key tokens/s "
      f"(successful requests, over {r['duration_s']:.1f} s)")
    try:
        planned = run_seconds(c["run_time"])
    except ValueError:  # a form Locust took and this parser does not know: no note
        planned = 0.0
    window = r["duration_s"]
    if window < 0.5 * planned:
        p(f"NOTE: these statistics cover only the last {window:.1f} s of the {planned:.0f} s run: Locust "
          "started them late (a long spawn, or workers lost and re-added while the load generator was "
          "too busy; see its log); answers before that are not counted")
    p(f"failures: {r['failures']} of {r['requests']}")
    if s.get("sessions_left") is not None:
        p(f"sessions the users left held (ended by the runner): {s['sessions_left']}")
    for e in r.get("errors", [])[:10]:
        p(f"  {e['occurrences']}x {e['type']} {e['name']}: {e['error'][:300]}")
    b = s.get("batch_sizes")
    if b is None:
        p("server batch sizes: no *batch_size* histogram on /metrics")
    else:
        mean = "n/a" if b["mean"] is None else f"{b['mean']:.2f}"
        p(f"server batch sizes ({', '.join(b['histograms'])}): {b['launches']:.0f} launches, "
          f"mean {mean} requests/launch; launches by size <= le: {b['launches_by_size_le']}")
    for m in s.get("memory") or []:
        p(f"memory {m['source']} {m['metric']}: first {m['first'] / 2**20:.0f} MiB, "
          f"max {m['max'] / 2**20:.0f} MiB, last {m['last'] / 2**20:.0f} MiB, "
          f"growth {m['growth'] / 2**20:+.0f} MiB over "
          f"{m['samples']} samples -> {'flat' if m['flat'] else 'GROWING'}")


# ---------------------------------------------------------------- the run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default=os.environ.get("LOADTEST_HOST", "http://127.0.0.1:8000"),
                    help="HTTP base URL of the server [env LOADTEST_HOST]")
    ap.add_argument("--grpc-target", default="", help="host:port of gRPC (default: the host, port 8001)")
    ap.add_argument("--users", "-u", type=int, default=16)
    ap.add_argument("--spawn-rate", "-r", type=float, default=None,
                    help="users started per second (default: all in 1 s)")
    ap.add_argument("--run-time", "-t", default="30s", help="e.g. 30s, 5m")
    ap.add_argument("--processes", type=int, default=1, help="Locust worker processes (-1: one per CPU)")
    ap.add_argument("--mix", default=os.environ.get("LOADTEST_MIX", "small"),
                    choices=sorted(payloads.MIXES) + sorted(sessions.SESSION_MIXES),
                    help="stateless mixes (loadtest/payloads.py) for st, json, oip, grpc; session mixes "
                         "(loadtest/sessions.py) for session")
    ap.add_argument("--user-class", default=None,
                    help="default: session for a session mix, else st. "
                         f"Comma-separated: {', '.join(f'{k} ({v})' for k, v in USER_CLASSES.items())}")
    ap.add_argument("--tag", default=None, help="report file prefix (default: <mix>_<classes>_u<users>)")
    ap.add_argument("--reports-dir", default="reports")
    ap.add_argument("--no-html", action="store_true", help="skip Locust's HTML report")
    ap.add_argument("--locust-loglevel", default="WARNING",
                    help="Locust's own log level (INFO shows workers lost and re-added: missed heartbeats)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="client-side timeout per request, s")
    ap.add_argument("--api-key", default=os.environ.get("LOADTEST_API_KEY"), help="[env LOADTEST_API_KEY]")
    ap.add_argument("--sample-memory", action="append", default=[], metavar="PID|URL|nvidia-smi",
                    help="sample memory during the run (repeatable): a PID's resident set (with children), a "
                         "server URL's /metrics memory series, or nvidia-smi; writes <tag>_memory.csv")
    ap.add_argument("--sample-interval", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--stop-timeout", type=float, default=10.0,
                    help="seconds users may take to finish the request in flight at the end")
    ap.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                    help="recorded in the summary's config (e.g. batching=off), for loadtest.report")
    ap.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics for batch sizes")
    ap.add_argument("locust_args", nargs=argparse.REMAINDER, help="after --: passed to locust unchanged")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.users < 1:
        raise SystemExit(f"--users must be at least 1, got {a.users}")
    try:
        run_seconds(a.run_time)
    except ValueError as exc:
        raise SystemExit(f"--run-time: {exc}") from None
    session_mix = a.mix in sessions.SESSION_MIXES
    user_class = a.user_class or ("session" if session_mix else "st")
    classes = [c.strip() for c in user_class.split(",") if c.strip()]
    unknown = [c for c in classes if c not in USER_CLASSES]
    if unknown or not classes:
        raise SystemExit(f"unknown --user-class {unknown}; choose from {', '.join(USER_CLASSES)}")
    if a.users < len(classes):  # Locust gives each class its share, rounded: some would get none
        raise SystemExit(f"--users {a.users} is fewer than the {len(classes)} user classes of --user-class "
                         f"{','.join(classes)}: each class needs at least one user")
    if session_mix != (classes == ["session"]):
        raise SystemExit(f"--mix {a.mix} is for --user-class {'session' if session_mix else 'st, json, oip, grpc'}; "
                         f"the session user takes the mixes {', '.join(sessions.SESSION_MIXES)}")
    host = a.host.rstrip("/")
    grpc_target = a.grpc_target or f"{urlparse(host).hostname}:8001"
    tag = a.tag or f"{a.mix}_{'+'.join(classes)}_u{a.users}"
    reports = Path(a.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    prefix = reports / tag
    spawn_rate = a.spawn_rate or max(1.0, float(a.users))

    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "-H", host, "-u", str(a.users), "-r", f"{spawn_rate:g}", "-t", a.run_time,
           "--stop-timeout", f"{a.stop_timeout:g}",
           "--csv", str(prefix), "--mix", a.mix, "--grpc-target", grpc_target,
           "--request-timeout", f"{a.request_timeout:g}", "--final-stats", f"{prefix}_final.json",
           "--loglevel", a.locust_loglevel]
    if a.api_key:
        cmd += ["--api-key", a.api_key]
    session_prefix = f"lt-{os.getpid()}-{os.urandom(4).hex()}-" if "session" in classes else ""
    if session_prefix:
        cmd += ["--session-prefix", session_prefix]
    if not a.no_html:
        cmd += ["--html", f"{prefix}.html"]
    if a.processes != 1:
        # A port of this run's own: on Locust's default (5557) the workers of a previous run, still
        # finishing long calls, join the next run's master, which then counts their calls as its own
        # and loses its user count (docs/benchmarks/service.md).
        port = free_port()
        cmd += ["--processes", str(a.processes), "--master-bind-port", str(port), "--master-port", str(port)]
    cmd += [a for a in a.locust_args if a != "--"] + [USER_CLASSES[c] for c in classes]

    final = Path(f"{prefix}_final.json")
    final.unlink(missing_ok=True)
    metrics_url = host + "/metrics"
    before = None if a.no_metrics else scrape(metrics_url, a.api_key)
    sampler = None
    if a.sample_memory:
        sampler = MemorySampler(a.sample_memory, Path(f"{prefix}_memory.csv"), a.sample_interval, a.api_key)
        sampler.start()
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, env=env, cwd=root, start_new_session=True)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # let Locust write its reports
        proc.send_signal(signal.SIGINT)
        rc = proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):  # workers the master left behind
            os.killpg(proc.pid, signal.SIGKILL)
    if sampler is not None:
        sampler.stop()
    after = None if a.no_metrics else scrape(metrics_url, a.api_key)
    left = end_sessions(host, session_prefix, a.api_key) if session_prefix else None

    summary = {
        "config": {"tag": tag, "host": host, "grpc_target": grpc_target, "users": a.users,
                   "spawn_rate": spawn_rate, "run_time": a.run_time, "processes": a.processes,
                   "mix": a.mix, "user_classes": classes, "labels": dict(kv.split("=", 1) for kv in a.label),
                   "reports_prefix": str(prefix)},
        "result": summarize(final) if final.exists() else {"requests": 0, "failures": 0, "per_name": []},
        "batch_sizes": batch_sizes(before, after),
        "memory": sampler.summary() if sampler else None,
        "locust_exit_code": rc,
        "sessions_left": left,
    }
    Path(f"{prefix}_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print_summary(summary)
    failed = rc != 0 or summary["result"]["failures"] > 0 or summary["result"]["requests"] == 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
