"""Sessions (docs/api.md#sessions): keys and values kept on the server in a paged KV cache per worker.

    manager.py    the table, create/describe/list/delete, steps (atomic, ordered), idle expiry
    step.py       ``SessionStep``: the one internal step type (single or packed), ``SessionResult``
    scheduler.py  steps batched into paged launches per worker (``kernels.append_paged`` + ``attention_paged``)
    cache.py      ``KVCache``: the pages of one worker, per-geometry arenas under a byte budget
"""

from service.sessions.manager import SessionManager
from service.sessions.step import SessionResult, SessionStep, check_session_id

__all__ = ["SessionManager", "SessionResult", "SessionStep", "check_session_id"]
