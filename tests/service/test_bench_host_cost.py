"""``bench.host_cost`` against a real server with empty kernels: every transport's row is measured
(calls answered, the server's CPU read) and printed."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_host_cost_measures_every_transport():
    out = subprocess.run([sys.executable, "-m", "bench.host_cost", "--rounds", "1", "--seconds", "0.5",
                          "--threads", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\| (\w+) \| this checkout \| ([\d,]+) \(.*\) \| ([\d.]+) \(", out.stdout, re.M)
    assert [r[0] for r in rows] == ["http", "grpc", "step", "packed"], out.stdout
    for _, rate, cpu in rows:
        assert int(rate.replace(",", "")) > 0 and float(cpu) > 0, out.stdout
