"""Where the engine's host time goes on the small-request path (a diagnostic, not a benchmark).

    python -m bench.profile_engine [--seconds 3] [--batching on|off]

Runs bench.service's closed loop (64 submitters of 1x8x128x64 fp16) under yappi (CPU clock, every
thread) and then under torch.profiler (CPU ops and CUDA runtime calls), and prints the top entries.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

from bench.service import SMALL, _load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--batching", choices=("on", "off"), default="on")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    batching = args.batching == "on"
    warm = "x".join(map(str, SMALL))

    def run(**overrides) -> dict:
        return asyncio.run(_load(args.device, batching, SMALL, torch.float16, 64, args.seconds, warm, **overrides))

    print("plain:", run())
    for ms in (5.0, 0.5, 0.1):  # --gil-switch-interval-ms: the interpreter's default, ours, lower
        print(f"switch interval {ms} ms:", run(gil_switch_interval_ms=ms))
    try:
        import yappi
    except ImportError:
        yappi = None
    if yappi is not None:
        yappi.set_clock_type("cpu")
        yappi.start(builtins=True)
        print("under yappi:", run())
        yappi.stop()
        stats = yappi.get_func_stats()
        stats.sort("tsub", "desc")
        print("\n== yappi: top functions by own CPU time (all threads)")
        for s in stats[:40]:
            print(f"{s.tsub:8.3f}s own {s.ttot:8.3f}s total {s.ncall:9d} calls  {s.module}:{s.lineno} {s.name}")
        print("\n== yappi: threads")
        for t in yappi.get_thread_stats():
            print(f"{t.ttot:8.3f}s  {t.name} (id {t.id}, {t.sched_count} scheduled)")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        print("under torch.profiler:", run())
    print("\n== torch.profiler: top ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
