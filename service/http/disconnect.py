"""Requests whose client hung up are not computed: while a handler awaits the engine, a lost
connection cancels that wait, so that the request leaves the batcher's queue unlaunched
(``Batcher.submit``; counted in ``attnserve_requests_cancelled_total``), and the handler answers
499 to nobody (the status nginx logs for it; the route's metrics count it so).

The protocol (``service.http.limits.LimitedProtocol``) gives each request a list of callbacks in
its scope's state (``watch_request``) and calls them when the connection is lost before the answer
is complete (``client_gone``). Served otherwise (an in-process ASGI client), nothing is watched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from service.errors import Cancelled

T = TypeVar("T")

CALLBACKS = "attnserve.client_gone"  # key in scope["state"]: what to call when the client hangs up


class ClientGone(Cancelled):
    """The client disconnected before its answer was ready (nobody reads this answer)."""


def watch_request(scope: dict[str, Any]) -> None:
    """Protocol side: a new request's scope gets its (empty) list of callbacks."""
    scope["state"][CALLBACKS] = []


def client_gone(scope: dict[str, Any]) -> None:
    """Protocol side: the connection of the request of ``scope`` was lost before its answer."""
    for callback in list(scope.get("state", {}).get(CALLBACKS, ())):
        callback()


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled if the client disconnects meanwhile (then ``ClientGone``)."""
    callbacks: list[Callable[[], None]] | None = request.scope.get("state", {}).get(CALLBACKS)
    if callbacks is None:
        return await work
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def cancel() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    callbacks.append(cancel)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone or task.uncancel() > 0:  # cancelled for another reason too (shutdown)
            raise
        raise ClientGone("the client disconnected before its answer was ready") from None
    finally:
        callbacks.remove(cancel)
