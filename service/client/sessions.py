"""Sessions in the Python clients (docs/api.md#sessions): the logic both clients share; each transport
(``AttentionClient``, ``GrpcAttentionClient``) provides only the calls themselves.

    s = client.create_session(num_kv_heads=8, head_dim=128, dtype=torch.float16, layers=32)
    o = client.step(s, q, k, v, layer=0)                 # q (1, Hq, n, D), k/v (1, Hkv, n, D)
    o = client.step(s, q, layer=0)                       # q-only: attends to what is held
    o = client.packed_step([s1, s2], q, k, v, q_lengths) # q (T, Hq, D), k/v (T, Hkv, D)
    client.get_session(s)                                # {"session", "layers", "lengths", ...}
    client.delete_session(s)

    with client.session(num_kv_heads=8, head_dim=128, dtype=torch.float16, layers=32) as s:
        o = s.step(q, k, v, layer=i)                     # deleted on exit (404 ignored: ended already)

Steps are causal by default (bottom-right: the n queries are the sequence's last n positions).
``return_lse=True`` gives ``(o, lse)``; ``end=True`` releases the session after the step.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.wire import SESSION_HEADER

Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class Session:
    """A handle on a session held by the server; a context manager that deletes it on exit."""

    client: Any
    id: str
    layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def step(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
             **options: Any) -> Result:
        """``client.step(self, q, k, v, **options)``."""
        return self.client.step(self, q, k, v, **options)

    def info(self) -> dict[str, Any]:
        return self.client.get_session(self)

    def delete(self, missing_ok: bool = True) -> None:
        """End the session; with ``missing_ok`` an ended or expired one (404) is not an error."""
        try:
            self.client.delete_session(self)
        except Exception as exc:
            if not (missing_ok and getattr(exc, "code", None) == "not_found"):
                raise

    def __str__(self) -> str:
        return self.id

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.delete(missing_ok=True)
            return
        try:  # the body's error is the one to see; a failed delete (the server gone) would hide it
            self.delete(missing_ok=True)
        except Exception:  # noqa: BLE001 - the session expires on the server (--session-idle-s)
            pass


def session_id(session: Session | str) -> str:
    """A session's id; a clear TypeError for anything that is not a session or its id (a None
    would otherwise travel as the id 'None', or fail deep in URL quoting)."""
    if isinstance(session, Session):
        return session.id
    if not isinstance(session, str) or not session:
        raise TypeError(f"session must be a Session or its id (a non-empty string), got {session!r}")
    return session


def header_safe(value: str) -> bool:
    """Whether an HTTP header (gRPC metadata) value can be ``value`` as it is."""
    return value.isascii() and value.isprintable()


def checked_affinity(session_affinity: str | None) -> str | None:
    """A client's ``session_affinity=``: a header value, or a ValueError now rather than at each call."""
    if session_affinity is not None and not (isinstance(session_affinity, str) and header_safe(session_affinity)):
        raise ValueError(f"session_affinity must be printable ASCII (it travels as the {SESSION_HEADER} "
                         f"header), got {session_affinity!r}")
    return session_affinity


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch.float16 / "float16" / "torch.float16" -> "float16"."""
    return (dtype if isinstance(dtype, str) else str(dtype)).removeprefix("torch.")


def q_lengths_tensor(q_lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """A packed step's rows of q per session, as int32 [S]; integers only (2.9 is no row count)."""
    if q_lengths is None:
        raise TypeError("a packed step needs q_lengths: the rows of q of each session, in order")
    if not isinstance(q_lengths, torch.Tensor) and len(q_lengths) == 0:
        raise TypeError("q_lengths is empty: a packed step names at least one session, with its rows of q")
    t = torch.as_tensor(q_lengths)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"q_lengths must be integers (rows of q per session), got {t.dtype}")
    return t.to(torch.int32).reshape(-1)


def session_ids(sessions: Sequence[Session | str] | Session | str) -> list[str]:
    """A packed step's sessions (Session handles or ids; one alone is a list of one) -> their ids."""
    if isinstance(sessions, (Session, str)):
        return [session_id(sessions)]
    return [session_id(s) for s in sessions]


class SessionsMixin:
    """Session calls over a transport's ``_create_session``, ``_session_step``, ``_get_session`` and
    ``_delete_session`` (each takes and gives plain values: dicts, tensors, ids, and the affinity key).

    Every session call carries an affinity key, which the transports send as the header (metadata)
    ``x-attnserve-session`` for a gateway to hash on (docs/deploy.md, "Sessions across replicas"):
    ``session_affinity`` when the client was given one (a stack that packs sessions together), else
    the call's session id (a packed step's first). A session created without an id gets one made
    here, so that its create is routed as its later calls are."""

    session_affinity: str | None = None

    def _affinity(self, session: str) -> str | None:
        """The call's affinity key; None (no header) for an id a header cannot carry (not printable
        ASCII): the server then names what is wrong with it (400)."""
        key = self.session_affinity or session
        return key if header_safe(key) else None

    def create_session(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str = torch.float16,
                       layers: int = 1, session: str | None = None) -> Session:
        """A new session on the server, named ``session`` (else a fresh random id)."""
        session = session or uuid.uuid4().hex
        info = self._create_session({"session": session, "layers": layers, "num_kv_heads": num_kv_heads,
                                     "head_dim": head_dim, "dtype": dtype_name(dtype)}, self._affinity(session))
        return Session(self, info["session"], info["layers"], info["num_kv_heads"], info["head_dim"],
                       info["dtype"])

    def session(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str = torch.float16,
                layers: int = 1, session: str | None = None) -> Session:
        """``create_session``, for ``with``: the session is deleted on exit."""
        return self.create_session(num_kv_heads, head_dim, dtype, layers, session)

    def step(self, session: Session | str, q: torch.Tensor, k: torch.Tensor | None = None,
             v: torch.Tensor | None = None, *, layer: int = 0, causal: bool = True, scale: float | None = None,
             return_lse: bool = False, end: bool = False, layout: str = "bhnd",
             window_size: Sequence[int] | None = None, softcap: float | None = None,
             alibi_slopes: torch.Tensor | None = None) -> Result:
        """One step: q (1, Hq, n, D), k/v (1, Hkv, n, D) (or none) -> o (1, Hq, n, D) [, lse (1, Hq, n)].
        window_size, softcap, alibi_slopes (float32 (Hq,)): as ``attention``'s, the step's rows at
        the session's last positions."""
        options = {"layer": layer, "causal": causal, "scale": scale, "return_lse": return_lse, "end": end,
                   "layout": layout, "window_size": window_size, "softcap": softcap}
        sid = session_id(session)
        o, lse = self._session_step([sid], {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes}, options,
                                    self._affinity(sid))
        return (o, lse) if return_lse else o

    def packed_step(self, sessions: Sequence[Session | str], q: torch.Tensor, k: torch.Tensor | None,
                    v: torch.Tensor | None, q_lengths: torch.Tensor | Sequence[int], *, layer: int = 0,
                    causal: bool = True, scale: float | None = None, return_lse: bool = False,
                    end: bool = False, window_size: Sequence[int] | None = None, softcap: float | None = None,
                    alibi_slopes: torch.Tensor | None = None) -> Result:
        """Many sessions' rows in one call: q (T, Hq, D), k/v (T, Hkv, D) (or none), q_lengths [S]
        -> o (T, Hq, D) [, lse (Hq, T)]. alibi_slopes: float32 (Hq,) or (S, Hq), one row per session."""
        options = {"layer": layer, "causal": causal, "scale": scale, "return_lse": return_lse, "end": end,
                   "window_size": window_size, "softcap": softcap}
        tensors = {"q": q, "k": k, "v": v, "q_lengths": q_lengths_tensor(q_lengths), "alibi_slopes": alibi_slopes}
        ids = session_ids(sessions)
        o, lse = self._session_step(ids, tensors, options, self._affinity(ids[0] if ids else ""))
        return (o, lse) if return_lse else o

    def get_session(self, session: Session | str) -> dict[str, Any]:
        """{"session", "layers", "num_kv_heads", "head_dim", "dtype", "lengths", "kv_bytes", "idle_s", "device"}"""
        sid = session_id(session)
        return self._get_session(sid, self._affinity(sid))

    def delete_session(self, session: Session | str) -> None:
        sid = session_id(session)
        self._delete_session(sid, self._affinity(sid))

    # ---- the transport's part ------------------------------------------------------------------

    def _create_session(self, fields: dict[str, Any], affinity: str) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def _session_step(self, sessions: list[str], tensors: dict[str, torch.Tensor | None], options: dict[str, Any],
                      affinity: str) -> tuple[torch.Tensor, torch.Tensor | None]:  # pragma: no cover
        raise NotImplementedError

    def _get_session(self, session: str, affinity: str) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def _delete_session(self, session: str, affinity: str) -> None:  # pragma: no cover
        raise NotImplementedError
