"""What the runner reads off the server while it runs: its ``/metrics`` page (``scrape``), and its
memory (``loadtest.run --sample-memory``: a process tree's resident set, the ``/metrics`` memory
series, or ``nvidia-smi``, sampled every few seconds into a CSV).
"""

from __future__ import annotations

import csv
import re
import statistics
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse


def scrape(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, float] | None:
    """GET a Prometheus text page -> {'name{labels}': value}; None when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def tree_rss(pid: int) -> float:
    """Resident bytes of a process and its descendants (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += float(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total


def _sample(source: str, api_key: str | None) -> dict[str, float]:
    if source.isdigit():
        return {"rss_bytes": tree_rss(int(source))}
    if source == "nvidia-smi":
        try:
            query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return {f"gpu{i.strip()}_used_bytes": float(m) * 2**20
                for i, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}
    url = source if urlparse(source).path not in ("", "/") else source.rstrip("/") + "/metrics"
    metrics = scrape(url, api_key) or {}
    return {k: v for k, v in metrics.items()
            if re.search(r"memory|resident", k.split("{")[0]) and not k.split("{")[0].endswith("_created")}


@dataclass
class MemorySampler:
    """Samples each source every ``interval`` s in a thread; writes time_s,source,metric,value rows.

    A source is a PID (resident memory of it and its children), a server URL (its /metrics series
    whose names hold "memory" or "resident", e.g. attnserve_gpu_memory_used_bytes), or nvidia-smi.
    """

    sources: list[str]
    path: Path
    interval: float = 5.0
    api_key: str | None = None  # for a URL source of a server that needs one
    rows: list[tuple[float, str, str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._take()  # one last sample after the load
        with open(self.path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["time_s", "source", "metric", "value"])
            w.writerows((f"{t:.1f}", s, m, f"{v:.0f}") for t, s, m, v in self.rows)

    def _take(self) -> None:
        t = time.monotonic() - self._t0
        for s in self.sources:
            for metric, value in _sample(s, self.api_key).items():
                self.rows.append((t, s, metric, value))

    def _loop(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.interval):
                return

    def summary(self) -> list[dict]:
        """Per series: first, max, last, and growth = median of the last quarter of the samples minus
        the median of the second quarter (after warm-up). Flat: growth within max(5%, 64 MiB)."""
        series: dict[tuple[str, str], list[float]] = {}
        for _, s, m, v in self.rows:
            series.setdefault((s, m), []).append(v)
        out = []
        for (s, m), vals in series.items():
            n = len(vals)
            q = max(1, n // 4)
            early = statistics.median(vals[q:2 * q] if n >= 4 else vals[:1])
            late = statistics.median(vals[-q:])
            growth = late - early
            out.append({"source": s, "metric": m, "samples": n, "first": vals[0], "max": max(vals),
                        "last": vals[-1], "growth": growth,
                        "flat": growth <= max(0.05 * early, 64 * 2**20)})
        return out
