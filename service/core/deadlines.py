"""The batcher's deadlines: requests queued past their deadline are answered DeadlineExceeded by
one timer, whatever the dispatcher is doing."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any

from service.errors import DeadlineExceeded


class Deadlines:
    """The queued requests' deadlines: one timer, armed for the earliest, answers every request
    past its deadline (DeadlineExceeded) and re-arms for the next. A heap of [deadline, seq,
    pending]; an answered request's entry is marked dead (pending None) and dropped lazily."""

    def __init__(self):
        self.heap: list[list] = []
        self._seq = itertools.count()  # ties: no comparison ever reaches the Pending
        self._dead = 0  # entries whose pending is None
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: float | None = None

    def add(self, pending: Any) -> list | None:
        """Watch ``pending``'s deadline (none: nothing to watch); the entry to ``forget`` later."""
        deadline = pending.request.deadline
        if deadline is None:
            return None
        entry = [deadline, next(self._seq), pending]
        heapq.heappush(self.heap, entry)
        if self._armed_for is None or deadline < self._armed_for:
            self._arm(deadline)
        return entry

    def forget(self, entry: list) -> None:
        """An answered request's entry is dead; the heap is rebuilt once most entries are, so that
        answered requests (their tensors) are not held until their deadlines."""
        if entry[2] is None:  # already popped by the sweep
            return
        entry[2] = None
        self._dead += 1
        if self._dead > 64 and 2 * self._dead > len(self.heap):
            self.heap = [e for e in self.heap if e[2] is not None]
            heapq.heapify(self.heap)
            self._dead = 0

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = self._armed_for = None

    def _arm(self, deadline: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        # req.deadline is on time.monotonic()'s clock; the loop may have its own
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(loop.time() + (deadline - time.monotonic()), self._sweep)
        self._armed_for = deadline

    def _sweep(self) -> None:
        self._handle = self._armed_for = None
        heap, now = self.heap, time.monotonic()
        while heap and (heap[0][0] <= now or heap[0][2] is None):
            entry = heapq.heappop(heap)
            pending = entry[2]
            if pending is None:
                self._dead -= 1
                continue
            entry[2] = None
            pending.resolve(DeadlineExceeded("the request's deadline passed before it was answered"))
        if heap:
            self._arm(heap[0][0])
