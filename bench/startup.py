"""Start-up benchmark: how long a fresh ``python -m service`` takes to answer ``/readyz`` 200.

    python -m bench.startup --out $OUT/startup.md               # on a GPU box: cuda:0, every mode
    python -m bench.startup --modes processes --device cpu      # anywhere (a CPU start)
    python -m bench.startup -- --warmup-shapes 1x32x4096x128    # server flags after --

For each --precompile mode (processes, threads, off) the server starts twice on one new, empty
TRITON_CACHE_DIR: cold (nothing compiled, no autotune choice stored), then warm (the same folder,
as a restarted pod on its cache volume finds it). With the default --ablate, the processes mode
also starts warm once more with --no-autotune-cache (every autotuned key timed again). Each row:
seconds from the process's start to /readyz 200; from its log, when the first line came (the
imports done), when gRPC listened (the servers built), when the last worker was warm, the worker's
own warm-up seconds and the precompile line. Default warm-up (--warmup-shapes/--warmup-dtypes
defaults) unless server flags say otherwise. The table is written after every run, so a stopped run keeps its rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("processes", "threads", "off")
_WARM = re.compile(r"worker (\S+) warm in ([\d.]+)s")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)  # logging's asctime
_PRE = re.compile(r"precompile: (\d+) kernel variants recorded in ([\d.]+)s, (\d+) cached already, (\d+) compiled "
                  r"on (\d+) (\w+) in ([\d.]+)s \(([\d.]+)s of compiling\), (\d+) failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(device: str, mode: str, cache_dir: Path, extra: list[str], log_path: Path,
               timeout: float) -> dict:
    """Start the server, wait for /readyz 200 (or its exit, or ``timeout``), stop it: the row's facts."""
    import httpx

    http_port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_") and k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    cmd = [sys.executable, "-m", "service", "--device", device, "--host", "127.0.0.1", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--precompile", mode, *extra]
    t0, wall0 = time.monotonic(), time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ready = None
    try:
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=1.0).status_code == 200:
                    ready = time.monotonic() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")
    row = {"ready_s": ready, "exit": None if ready is not None else proc.returncode, "log": str(log_path)}
    if m := _WARM.search(text):
        row["warmup_s"] = float(m.group(2))
    row.update(_timeline(text, wall0))
    if m := _PRE.search(text):
        rec, rec_s, cached, compiled, workers, kind, wall, total, failed = m.groups()
        row["precompile"] = (f"{rec} variants ({rec_s} s to list): {cached} cached, {compiled} compiled on "
                             f"{workers} {kind} in {wall} s ({total} s of compiling), {failed} failed")
    elif "precompile: skipped" in text:
        row["precompile"] = "skipped: the warm-up's marker was found (all compiled by an earlier start)"
    elif "precompile failed" in text:
        row["precompile"] = "failed (see the log): the warm-up compiled alone"
    return row


def _timeline(text: str, wall0: float) -> dict:
    """Seconds from the process's start to its first log line (the imports done), to "gRPC
    listening" (the servers built) and to the last worker's "warm in", read off the log's
    timestamps (millisecond resolution, the host's clock)."""

    def rest_of_line(m: re.Match) -> str:
        end = text.find("\n", m.end())
        return text[m.end():] if end < 0 else text[m.end():end]

    def at(line_pattern: str, last: bool = False) -> float | None:
        hits = [m for m in _STAMP.finditer(text) if re.search(line_pattern, rest_of_line(m))]
        if not hits:
            return None
        stamp = (hits[-1] if last else hits[0]).group(1)
        return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall0

    return {"first_log_s": at(""), "listening_s": at("gRPC listening"), "warm_end_s": at(r"warm in", last=True)}


def _cell(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(rows: list[dict], device: str, extra: list[str]) -> str:
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else "none"
    lines = [
        "## Start-up: time to /readyz 200", "",
        f"{dt.date.today()}, {platform.node()}, GPU {gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"triton {triton.__version__}; `{' '.join(['python -m service --device', device, *extra])}`",
        "",
        "| --precompile | Triton cache | autotune cache | ready after (s) | first log line (s) | gRPC listening (s) "
        "| warm-up ends (s) | worker warm-up (s) | precompile |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ready = _cell(r["ready_s"]) if r["ready_s"] is not None else f"not ready (exit {r['exit']})"
        lines.append(f"| {r['mode']} | {r['cache']} | {r['autotune']} | {ready} | {_cell(r.get('first_log_s'))} "
                     f"| {_cell(r.get('listening_s'))} | {_cell(r.get('warm_end_s'))} | {_cell(r.get('warmup_s'))} "
                     f"| {r.get('precompile', '-')} |")
    lines += ["", "Targets: cold <= 30 s, warm <= 5 s. Server logs: " + ", ".join(
        sorted({str(Path(r['log']).parent) for r in rows})), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="the server's --device (default: cuda:0 if CUDA, else cpu)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated --precompile modes (default on a GPU: {','.join(MODES)}; on a CPU: "
                             "processes, since nothing is compiled there)")
    parser.add_argument("--no-ablate", dest="ablate", action="store_false",
                        help="skip the warm start with --no-autotune-cache")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take to get ready")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here (also printed)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="folder for the server logs (default: startup-logs next to --out, else a temp dir)")
    parser.add_argument("--keep-cache", action="store_true", help="keep the Triton cache folders (else removed)")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    modes = args.modes.split(",") if args.modes else (list(MODES) if on_gpu else ["processes"])
    logs = args.logs or (args.out.parent / "startup-logs" if args.out else
                         Path(tempfile.mkdtemp(prefix="attnserve-startup-logs-")))
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def run(mode, cache_dir, cache, autotune, flags):
        row = start_once(device, mode, cache_dir, extra + flags, logs / f"{mode}-{cache}-{autotune}.log",
                         args.timeout)
        rows.append({"mode": mode, "cache": cache, "autotune": autotune, **row})
        print(f"{mode:9s} {cache:5s} autotune {autotune:4s}: ready after {_cell(row['ready_s'])} s "
              f"(warm-up {_cell(row.get('warmup_s'))} s) {row.get('precompile', '')}", flush=True)
        text = table(rows, device, extra)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)

    for mode in modes:
        cache_dir = Path(tempfile.mkdtemp(prefix=f"attnserve-triton-{mode}-"))
        try:
            run(mode, cache_dir, "cold", "on", [])
            run(mode, cache_dir, "warm", "on", [])
            if args.ablate and mode == modes[0]:
                run(mode, cache_dir, "warm", "off", ["--no-autotune-cache"])
        finally:
            if not args.keep_cache:
                shutil.rmtree(cache_dir, ignore_errors=True)
    print(table(rows, device, extra))


if __name__ == "__main__":
    main()
