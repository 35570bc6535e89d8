"""Sessions across processes (docs/api.md#sessions; docs/architecture.md "Sessions across processes").

Under ``--processes N`` the kernel hands each connection to any of the N processes, but a session's
keys and values live in one of them. So:

- the owner of a session id is a pure function of the id and N, the same in every process:
  ``owner(id, N) = zlib.crc32(group.encode()) % N`` (``owner``), where the group is the id's part
  before its first ``:`` (the whole id when it has none or starts with one); clients may compute it
  too, and sessions named ``<group>:<anything>`` always live in one process, so they can always be
  packed together (``SessionCache`` names a batch's sessions so);
- a server-made id is drawn until it lands on the process that makes it (``SessionIds``), so a
  ``POST /sessions`` without an id is never forwarded;
- each process also listens on private unix sockets in the supervisor's private folder
  (``<folder>/http-<i>.sock``, ``<folder>/grpc-<i>.sock``; the folder, i and N reach the process as
  ``--peers I/N@FOLDER``); a session call that reaches a non-owner is forwarded there: HTTP by
  ``service.http.forward.HTTPRouter`` (an ASGI wrapper around the whole app, for ``/sessions`` paths
  and OIP infer calls only) streaming the body through, the owner's status, headers and body sent
  back unchanged (plus one header, ``x-attnserve-forwarded: <front>-><owner>``); gRPC by
  ``service.grpc.forward.forward_grpc``, which a session rpc calls at its top when ``grpc_owner``
  says another process holds its sessions;
- ``GET /sessions`` answers the union over every process (counts and bytes summed, ids joined),
  with ``"processes": N``;
- a packed step whose sessions all have one owner is forwarded whole; one naming sessions of
  several owners is a 422 that lists which sessions live together (a stack groups its packed
  steps by ``owner``);
- an Open Inference Protocol infer call with a ``sequence_id`` goes to the owner of its session
  (``str(sequence_id)``), over HTTP (the router reads only the call's JSON header) and gRPC
  (``ModelInfer``; ``ModelStreamInfer`` forwards each such message as a ``ModelInfer``).

A forwarded call carries ``x-attnserve-forwarded`` (HTTP) or metadata of that name (gRPC): the owner
serves it locally whatever it computes, so a call is forwarded at most once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import uuid
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from service.errors import InvalidInput

FORWARDED = "x-attnserve-forwarded"
UNION_PART = ":union-part"  # ends FORWARDED's value on the other processes' parts of a GET /sessions
# A forwarded call's deadline as the accepting process set it: a time.monotonic() instant (Linux's
# CLOCK_MONOTONIC, one clock for every process of the host). The owner keeps the earlier of it and
# its own, so a call it reads late (it was stalled) is not given a fresh deadline.
HOP_DEADLINE = "x-attnserve-deadline"
HOP_GRACE_S = 1.0  # the accepting process waits this long past the deadline for the owner's own answer


def hop_deadline(value: str | bytes | None) -> float | None:
    """HOP_DEADLINE's value -> the instant; None when absent or not a finite number."""
    try:
        t = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return t if math.isfinite(t) else None


def owner(session: str, processes: int) -> int:
    """The index of the process that holds ``session`` among ``processes``: that of its group (the
    part before its first ":", the whole id when there is none or it comes first)."""
    if processes <= 1:
        return 0
    group = session.split(":", 1)[0] or session
    return zlib.crc32(group.encode("utf-8")) % processes


@dataclass(frozen=True)
class Peers:
    """This process's place among the supervisor's children."""

    index: int
    count: int
    folder: str

    @classmethod
    def parse(cls, value: str) -> Peers:
        """``I/N@FOLDER`` -> Peers; a ValueError that says what is wrong."""
        place, sep, folder = value.partition("@")
        index, sep2, count = place.partition("/")
        try:
            i, n = int(index), int(count)
        except ValueError:
            i = n = -1
        if not (sep and sep2 and folder and 0 <= i < n):
            raise ValueError(f"--peers {value!r}: expected INDEX/COUNT@FOLDER, e.g. 0/2@/tmp/attnserve-peers-x")
        return cls(i, n, folder)

    def owner(self, session: str) -> int:
        return owner(session, self.count)

    def http_path(self, i: int) -> str:
        return os.path.join(self.folder, f"http-{i}.sock")

    def grpc_path(self, i: int) -> str:
        return os.path.join(self.folder, f"grpc-{i}.sock")


@functools.lru_cache(maxsize=8)
def _parse(value: str) -> Peers:
    return Peers.parse(value)


def peers_of(settings: Any) -> Peers | None:
    """The Peers of a process started by ``--processes`` (with more than one process), else None."""
    value = getattr(settings, "peers", None)
    if not value:
        return None
    p = _parse(value)
    return p if p.count > 1 else None


def new_session_id(settings: Any) -> Callable[[], str]:
    """What a process draws server-made ids with: ids it owns (1/N of the draws land; a few draws)."""
    p = peers_of(settings)
    if p is None:
        return lambda: uuid.uuid4().hex

    def draw() -> str:
        while True:
            sid = uuid.uuid4().hex
            if p.owner(sid) == p.index:
                return sid

    return draw


def owners_of(p: Peers, sessions: Iterable[str]) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for s in sessions:
        groups.setdefault(p.owner(s), []).append(s)
    return groups


def single_owner(p: Peers, sessions: list[str]) -> int:
    """The owner of all of ``sessions``, or an InvalidInput (422) that says which live together."""
    groups = owners_of(p, sessions)
    if len(groups) <= 1:
        return next(iter(groups), p.index)
    together = "; ".join(f"process {i}: {', '.join(ids)}" for i, ids in sorted(groups.items()))
    raise InvalidInput(
        f"a packed step's sessions must live in one process, and these live in {len(groups)} of the server's "
        f"{p.count} ({together}); name sessions you pack together with one group before a ':' (g:0, g:1, "
        f"...: they live in one process), or send one packed step per process (a session's process is "
        f"zlib.crc32(group) % {p.count}, GET /sessions says 'processes')"
    )


# ---- private listeners ------------------------------------------------------------------------


def unix_listener(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (any stale file there removed), readable by us only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def http_listeners(settings: Any) -> list[socket.socket]:
    """The private HTTP listener of this process (none outside ``--processes``)."""
    p = peers_of(settings)
    return [] if p is None else [unix_listener(p.http_path(p.index))]


def add_grpc_port(server: Any, settings: Any) -> None:
    """Bind ``server`` also to this process's private gRPC socket (under ``--processes``)."""
    p = peers_of(settings)
    if p is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p.grpc_path(p.index))
        server.add_insecure_port("unix:" + p.grpc_path(p.index))
