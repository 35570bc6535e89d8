"""The one internal type of a session step (docs/api.md#sessions), what every transport builds, and its result.

A single step and a packed step are one ``SessionStep``: S sessions' new rows in flash-attn's varlen
packing, checked once when it is built (``SessionStep.single`` / ``SessionStep.packed``):

    q: (T, Hq, D)             the sessions' query rows, session s being rows q_lengths[:s].sum() + ...
    k, v: (T, Hkv, D) | None  the same rows' new keys and values (both, or neither: a q-only step)
    q_lengths: S ints         rows per session, summing to T

A single step's q arrives as (1, Hq, n, D) (bhnd) or (1, n, Hq, D) (bnhd) and is held as the view
(n, Hq, D); its answer goes back as (1, Hq, n, D) in its layout and lse (1, Hq, n). A packed step's
answer is o (T, Hq, D), lse (Hq, T). The score modifiers (window_size, softcap, alibi_slopes:
float32 (Hq,) or (S, Hq)) mean what they mean for ``kernels.attention_paged``, each session's rows
at its last positions. What depends on the held sessions (their heads, head dim,
dtype, layers, lengths) is checked by ``SessionManager.step``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import kernels
from kernels.masks import check_masks
from service.core.types import LAYOUTS, Stamps, new_request_id
from service.errors import BadRequest, InvalidInput, from_kernel_error

MAX_HEAD_DIM = 256
STEP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def shown_id(session: Any) -> str:
    """A session id as an error message quotes it: whole up to 64 characters, else its start and
    its length (a gRPC status message must fit the client's 16 KiB metadata limit)."""
    text = repr(session)
    if len(text) <= 66:
        return text
    return f"{text[:64]}... ({len(session) if isinstance(session, str) else '?'} characters)"


def check_session_id(session: str) -> str:
    """A client-chosen id: 1-128 characters of A-Za-z0-9._:- , not 'attend', not only dots (400)."""
    if not isinstance(session, str) or not _SESSION_ID.fullmatch(session) or session == "attend" \
            or set(session) == {"."}:
        raise BadRequest(
            f"session id {shown_id(session)} is not valid: use 1-128 characters of A-Z a-z 0-9 . _ : - "
            "(not 'attend', not only dots), or leave it out and the server makes one"
        )
    return session


@dataclass
class SessionResult:
    """o: (1, Hq, n, D) in the step's layout, or (T, Hq, D) packed; lse: (1, Hq, n) / (Hq, T) float32."""

    o: torch.Tensor
    lse: torch.Tensor | None = None
    request_id: str = ""
    lengths: list[int] = field(default_factory=list)  # each session's layer length after the step
    stamps: Stamps | None = None  # the engine's phases (``service.core.types.Stamps``)


@dataclass(eq=False)
class SessionStep:
    sessions: tuple[str, ...]
    q: torch.Tensor  # (T, Hq, D)
    k: torch.Tensor | None  # (T, Hkv, D) or None
    v: torch.Tensor | None
    q_lengths: tuple[int, ...]
    layer: int = 0
    causal: bool = True
    scale: float | None = None
    return_lse: bool = False
    end: bool = False
    layout: str | None = None  # "bhnd"/"bnhd": a single step (4-D answer); None: a packed step
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # float32 (Hq,) or (S, Hq)
    request_id: str = field(default_factory=new_request_id)
    deadline: float | None = None  # time.monotonic() after which the step must not launch
    arrived: float = field(default_factory=time.monotonic)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def single(cls, session: str, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
               *, layout: str = "bhnd", **options) -> SessionStep:
        """One session's step: q (1, Hq, n, D), k/v (1, Hkv, n, D) in bhnd, or (1, n, H, D) in bnhd."""
        if layout not in LAYOUTS:
            raise BadRequest(f"unknown layout {layout!r}; use 'bhnd' (the default) or 'bnhd' (flash-attn's)")
        dims = "[1, N, H, D]" if layout == "bnhd" else "[1, H, N, D]"
        packed = []
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is None:
                packed.append(None)
                continue
            _check_tensor(name, t)
            if t.dim() != 4 or t.shape[0] != 1:
                raise InvalidInput(f"{name} of a step must have 4 dims {dims} (B = 1), got {list(t.shape)}")
            packed.append(t[0] if layout == "bnhd" else t[0].transpose(0, 1))  # -> (n, H, D), a view
        n, d = packed[0].shape[0], packed[0].shape[2]
        k_, v_ = packed[1], packed[2]
        if k_ is not None and v_ is not None and (k_.shape != v_.shape or k_.shape[0] != n or k_.shape[2] != d):
            raise InvalidInput(f"k and v of a step must be {dims} with q's N = {n} and D = {d}, got "
                               f"{list(k.shape)} and {list(v.shape)} (one new key and value a query row)")
        return cls((session,), packed[0], packed[1], packed[2], (n,), layout=layout, **options)

    @classmethod
    def packed(cls, sessions: Sequence[str], q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               q_lengths: torch.Tensor | Sequence[int], **options) -> SessionStep:
        """S sessions' rows: q (T, Hq, D), k/v (T, Hkv, D) or None, q_lengths (S,) summing to T."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None:
                _check_tensor(name, t)
                if t.dim() != 3:
                    raise InvalidInput(f"{name} of a packed step must have 3 dims [T, H, D], got {list(t.shape)}")
        if isinstance(q_lengths, torch.Tensor):
            if q_lengths.dtype not in (torch.int32, torch.int64) or q_lengths.dim() != 1:
                raise InvalidInput(f"q_lengths must be an int32 tensor [S], got {q_lengths.dtype} "
                                   f"{list(q_lengths.shape)}")
            lengths = tuple(int(x) for x in q_lengths.tolist())
        else:
            if not isinstance(q_lengths, list | tuple) or \
                    not all(isinstance(x, int) and not isinstance(x, bool) for x in q_lengths):
                raise BadRequest("q_lengths must be a list of integers (rows of q per session)")
            lengths = tuple(q_lengths)
        if isinstance(sessions, str) or not all(isinstance(s, str) for s in sessions):
            raise BadRequest("sessions must be a list of session ids")
        return cls(tuple(sessions), q, k, v, lengths, **options)

    def __post_init__(self) -> None:
        q, k, v = self.q, self.k, self.v
        if not self.sessions:
            raise BadRequest("a step names at least one session")
        if len(set(self.sessions)) != len(self.sessions):
            raise InvalidInput("a packed step names each session at most once")
        if (k is None) != (v is None):
            raise BadRequest(f"missing tensor {'v' if v is None else 'k'}: send both k and v, or neither "
                             "(a q-only step attends to what is held)")
        t, hq, d = q.shape
        if not 1 <= d <= MAX_HEAD_DIM:
            raise InvalidInput(f"head dim {d} is not supported (1 to {MAX_HEAD_DIM})")
        if k is not None:
            if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
                raise InvalidInput(f"k and v must be [T, Hkv, D] with q's T = {t} and D = {d}, got "
                                   f"{list(k.shape)} and {list(v.shape)} (packed, one row per query row)")
            if k.dtype != q.dtype or v.dtype != q.dtype:
                raise InvalidInput(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
            if k.shape[1] < 1 or hq % k.shape[1]:
                raise InvalidInput(f"q's {hq} heads must be a multiple of k's {k.shape[1]} (GQA)")
        if len(self.q_lengths) != len(self.sessions):
            raise InvalidInput(f"q_lengths has {len(self.q_lengths)} entries for {len(self.sessions)} sessions")
        if any(n < 0 for n in self.q_lengths) or sum(self.q_lengths) != t:
            raise InvalidInput(f"q_lengths {list(self.q_lengths)} must be >= 0 and add up to q's {t} rows")
        if self.layout is not None and t < 1:
            raise InvalidInput("a step needs at least one query row (n >= 1)")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise InvalidInput(f"layer must be an integer >= 0, got {self.layer!r}")
        if self.scale is not None and not math.isfinite(self.scale):
            raise BadRequest(f"option 'scale' must be finite, got {self.scale!r}")
        self.causal, self.return_lse, self.end = bool(self.causal), bool(self.return_lse), bool(self.end)
        try:  # the kernels' own check: the same rules and messages as /attention's
            self.masks = check_masks(self.window_size, self.softcap, self.alibi_slopes, rows=len(self.sessions),
                                     heads_q=hq, device=q.device, causal=self.causal, rows_name="S")
        except kernels.AttentionInputError as exc:
            raise from_kernel_error(exc) from None

    # ---- reading ------------------------------------------------------------------------------

    @property
    def mask_key(self) -> tuple:
        """What of the score modifiers a paged launch shares: the window, the cap and whether slopes
        are given (each sequence's slopes travel as its own row)."""
        m = self.masks
        return (m.left, m.right, m.softcap, m.alibi is not None)

    def alibi_row(self, index: int) -> torch.Tensor | None:
        """float32 (1, Hq): the slopes of the step's session ``index``, or None."""
        m = self.masks
        if m.alibi is None:
            return None
        return m.alibi[index : index + 1] if m.alibi.shape[0] > 1 else m.alibi

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]

    @property
    def heads_kv(self) -> int | None:
        return None if self.k is None else self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(first, end) rows of each session in q (and k, v)."""
        out, at = [], 0
        for n in self.q_lengths:
            out.append((at, at + n))
            at += n
        return out

    def result(self, o: torch.Tensor, lse: torch.Tensor, lengths: list[int],
               stamps: Stamps | None = None) -> SessionResult:
        """o (T, Hq, D) and lse (Hq, T) -> the answer in the step's own shapes."""
        if self.layout is not None:
            o = o.unsqueeze(0) if self.layout == "bnhd" else o.transpose(0, 1).unsqueeze(0)  # (1,n,H,D) / (1,H,n,D)
            lse = lse.unsqueeze(0)  # (1, Hq, n)
        return SessionResult(o=o.contiguous(), lse=lse.contiguous() if self.return_lse else None,
                             request_id=self.request_id, lengths=lengths, stamps=stamps)


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise BadRequest(f"{name} must be a tensor")
    if t.dtype not in STEP_DTYPES:
        raise InvalidInput(f"{name} has dtype {t.dtype}; steps take float16, bfloat16 or float32")
