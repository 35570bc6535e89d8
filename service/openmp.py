"""OpenMP's idle threads sleep instead of spinning; the one module that changes the OpenMP runtime's
defaults (libgomp, under torch's CPU operators).

What it changes: ``OMP_WAIT_POLICY=PASSIVE`` in the server's environment, before torch (and with it
libgomp, which reads the variable once, when it loads) is imported. ``python -m service`` calls
``configure`` first thing.

Why: by default a thread of torch's pool that finishes its share of a parallel operator spins for a
while before it sleeps. The server runs its event loop, its launcher and finisher threads and
grpc's threads beside that pool, so the spinning takes the cores they need: on a 2-core host a
CPU server answered a lone client's tiny requests 3.5x slower (76 against 268 req/s, see
docs/benchmarks/service.md#the-cpu-server), and on a GPU host the pool's copies into pinned memory
leave threads spinning beside the loop. The cost: waking a sleeping thread takes a few
microseconds more per parallel operator.

How to turn it off: set ``OMP_WAIT_POLICY`` yourself (``ACTIVE`` is OpenMP's spinning); a value
already in the environment is kept.
"""

from __future__ import annotations

from collections.abc import MutableMapping

POLICY = "PASSIVE"


def configure(environ: MutableMapping[str, str]) -> str:
    """Set ``OMP_WAIT_POLICY`` in ``environ`` (``os.environ``: before torch is imported) unless it is
    set; the policy in force."""
    return environ.setdefault("OMP_WAIT_POLICY", POLICY)
