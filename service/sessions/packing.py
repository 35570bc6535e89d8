"""The host side of one paged launch over session works: each sequence's lengths and block table as
one flat int32 index, and the q, k, v rows to stage. ``scheduler._enqueue`` and the CUDA graphs of
``graphs.StepGraph`` lay their inputs out alike with it.

The index of S sequences, in order: cu_q (S + 1), cu_new (S + 1), the lengths before the step (S)
and after it (S), then the block table (S, width), each row zero-padded past its pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.core.staging import copy_parts


@dataclass
class Packed:
    """What ``pack`` gathers of a launch's works."""

    flat: list[int]          # cu_q, cu_new, before, after
    tables: list[Any]        # each sequence's pages (int32 arrays)
    q_parts: list[torch.Tensor]
    k_parts: list[torch.Tensor]  # empty for q-only steps
    v_parts: list[torch.Tensor]
    slopes: list[torch.Tensor]   # each sequence's ALiBi row (1, Hq), when the steps have slopes

    @property
    def n_seq(self) -> int:
        return len(self.tables)

    @property
    def rows(self) -> int:
        return self.flat[self.n_seq]  # cu_q[-1]

    @property
    def width(self) -> int:
        """The widest table row: the launch's block table width."""
        return max(1, max(len(t) for t in self.tables))

    def index_len(self, width: int) -> int:
        return len(self.flat) + self.n_seq * width

    def fill_index(self, out: np.ndarray, width: int) -> None:
        """The flat index into ``out`` (int32, ``index_len(width)``), tables padded to ``width``."""
        n = len(self.flat)
        out[:n] = self.flat
        rows = out[n:].reshape(self.n_seq, width)
        rows[:] = 0
        for i, t in enumerate(self.tables):  # each table row is an int32 array: one copy, no conversion
            rows[i, : len(t)] = t

    def fill_rows(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """q (and k, v) rows into the host tensors given."""
        cat(self.q_parts, q)
        if self.k_parts:
            cat(self.k_parts, k)
            cat(self.v_parts, v)


def pack(works: list[Any]) -> Packed:
    """Gather the sequences of ``works`` (``scheduler.Work``s of one key, their lengths reserved)."""
    q_parts, k_parts, v_parts, slopes = [], [], [], []
    cu_q, cu_new, before, after, tables = [0], [0], [], [], []
    alibi = works[0].step.masks.alibi is not None
    for w in works:
        new = w.step.k is not None
        for s, c in zip(w.seqs, w.before, strict=True):
            if alibi:
                slopes.append(w.step.alibi_row(s.index))  # (1, Hq)
            n = s.rows[1] - s.rows[0]
            cu_q.append(cu_q[-1] + n)
            cu_new.append(cu_new[-1] + (n if new else 0))
            before.append(c)
            after.append(s.kv.length)
            tables.append(s.kv.pages)
        for a, b in runs([s.rows for s in w.seqs]):  # a work's rows are one run of the step's, mostly
            q_parts.append(w.step.q[a:b])  # (n, Hq, D)
            if new:
                k_parts.append(w.step.k[a:b])
                v_parts.append(w.step.v[a:b])
    return Packed(cu_q + cu_new + before + after, tables, q_parts, k_parts, v_parts, slopes)


def runs(rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first, end) row ranges, adjacent ones joined: [(0, 2), (2, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    out: list[tuple[int, int]] = []
    for a, b in rows:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def cat(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    if len(parts) == 1 or all(p.is_contiguous() for p in parts):
        copy_parts(out, parts)
    else:
        torch.cat(parts, out=out)
