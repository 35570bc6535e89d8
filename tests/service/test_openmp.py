"""service/openmp.py: ``python -m service`` sets OMP_WAIT_POLICY=PASSIVE before torch (and libgomp,
which reads it once, when it loads) is imported, and keeps a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.openmp import configure
from tests.conftest import ROOT

# records OMP_WAIT_POLICY at the moment torch is first looked up, then imports the entry point
PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
        return None
sys.meta_path.insert(0, Watch())
import service.__main__
print(seen[0] if seen else "torch not imported")
"""


def test_configure_sets_passive_and_keeps_a_users_value():
    env: dict[str, str] = {}
    assert configure(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert configure(env) == "ACTIVE" and env == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.parametrize("given, want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_entry_point_sets_it_before_torch_loads(given, want):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == want, out.stdout + out.stderr
