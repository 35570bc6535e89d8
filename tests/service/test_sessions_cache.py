"""The sessions' KV cache and table without a server: page accounting, growth, rollback, expiry."""

from __future__ import annotations

import pytest
import torch

from service.errors import Conflict, InsufficientStorage, NotFound, size_text
from service.sessions.cache import MIN_ARENA_PAGES, Geometry, KVCache, NoRoom, SequenceKV
from service.sessions.manager import Session, SessionTable
from service.sessions.step import SessionStep, check_session_id

G = Geometry(num_kv_heads=2, head_dim=8, dtype=torch.float32)
G2 = Geometry(num_kv_heads=1, head_dim=4, dtype=torch.float16)  # another arena
PAGE = 4  # tokens a page; G's page holds 2 * 4 * 2 * 8 * 4 = 512 bytes


def _fill(cache: KVCache, g: Geometry, kv: SequenceKV, start: int, n: int, value: float) -> None:
    """Write keys start..start+n-1 of ``kv`` as ``value + position`` (what append_paged would)."""
    arena = cache.arena(g)
    for j in range(start, start + n):
        arena.k[kv.pages[j // PAGE], j % PAGE] = value + j
        arena.v[kv.pages[j // PAGE], j % PAGE] = -(value + j)


def _keys(cache: KVCache, g: Geometry, kv: SequenceKV) -> list[float]:
    arena = cache.arena(g)
    return [float(arena.k[kv.pages[j // PAGE], j % PAGE, 0, 0]) for j in range(kv.length)]


def test_pages_taken_as_sequences_grow_and_returned():
    cache = KVCache("cpu", 64 * G.page_bytes(PAGE), PAGE)
    a, b = SequenceKV(), SequenceKV()
    cache.reserve(G, [(a, 5), (b, 1)])  # 2 pages + 1 page
    assert (a.length, len(a.pages), b.length, len(b.pages)) == (5, 2, 1, 1)
    assert cache.used_bytes == 3 * G.page_bytes(PAGE)
    cache.reserve(G, [(a, 3), (b, 0)])  # 8 keys: still 2 pages
    assert (a.length, len(a.pages)) == (8, 2)
    cache.reserve(G, [(a, 1)])
    assert len(a.pages) == 3 and len(set(a.pages) | set(b.pages)) == 4  # no page shared
    cache.release(G, [a])
    assert not a.pages and a.length == 0 and cache.used_bytes == G.page_bytes(PAGE)
    cache.release(G, [b])
    assert cache.used_bytes == 0 and cache.allocated_bytes == 0 and not cache.arenas  # tensors dropped


def test_rollback_restores_lengths_and_pages():
    cache = KVCache("cpu", 64 * G.page_bytes(PAGE), PAGE)
    a, b = SequenceKV(), SequenceKV()
    cache.reserve(G, [(a, 3), (b, 4)])
    before = (list(a.pages), list(b.pages), cache.used_bytes, cache.pages_free)
    r = cache.reserve(G, [(a, 6), (b, 1)])
    assert a.length == 9 and b.length == 5
    cache.rollback(r)
    assert (a.length, b.length) == (3, 4)
    assert (list(a.pages), list(b.pages), cache.used_bytes, cache.pages_free) == before


def test_no_room_changes_nothing_and_says_what_is_free():
    cache = KVCache("cpu", 4 * G.page_bytes(PAGE), PAGE)
    a, b = SequenceKV(), SequenceKV()
    cache.reserve(G, [(a, 12)])  # 3 of 4 pages
    with pytest.raises(NoRoom, match="are free") as err:
        cache.reserve(G, [(b, 4), (a, 4)])  # 2 more pages: over the budget
    assert err.value.http_status == 507
    page = G.page_bytes(PAGE)  # sizes in a unit they read in (a small cache once read "0.00 MiB")
    assert f"needs {size_text(2 * page)} more" in err.value.message and size_text(page) + " of " in err.value.message
    assert "0.00" not in err.value.message
    assert (a.length, len(a.pages), b.length, list(b.pages)) == (12, 3, 0, [])
    cache.reserve(G, [(b, 4)])  # the last page still fits
    assert cache.free_bytes == 0


def test_growth_keeps_every_key_in_place():
    cache = KVCache("cpu", 1024 * G.page_bytes(PAGE), PAGE)
    seqs = [SequenceKV() for _ in range(5)]
    for _ in range(8):  # interleaved growth past the first arena's MIN_ARENA_PAGES pages
        for i, kv in enumerate(seqs):
            start = kv.length
            cache.reserve(G, [(kv, 3)])
            _fill(cache, G, kv, start, 3, 1000.0 * i)
    assert cache.arena(G).size > MIN_ARENA_PAGES
    for i, kv in enumerate(seqs):
        assert _keys(cache, G, kv) == [1000.0 * i + j for j in range(kv.length)]


def test_a_full_budget_shrinks_other_geometries_free_pages():
    """An arena may not grow while another holds allocated but unused pages: those are repacked
    (their pages in use moved, remapped) so that the budget bounds the pages in use."""
    budget = 40 * G.page_bytes(PAGE)
    cache = KVCache("cpu", budget, PAGE)
    other = [SequenceKV() for _ in range(3)]
    for kv in other:
        cache.reserve(G, [(kv, 3 * PAGE)])
    for i, kv in enumerate(other):
        _fill(cache, G, kv, 0, kv.length, 100.0 * i)
    cache.release(G, [other[0]])  # frees low pages, so the others' pages must move when shrunk
    small = SequenceKV()
    need = (budget - cache.used_bytes) // G2.page_bytes(PAGE)  # every byte left, in G2 pages
    cache.reserve(G2, [(small, need * PAGE)])
    assert cache.allocated_bytes <= budget and cache.free_bytes < G2.page_bytes(PAGE)
    for i, kv in enumerate(other[1:], start=1):
        assert _keys(cache, G, kv) == [100.0 * i + j for j in range(kv.length)]
    with pytest.raises(NoRoom):
        cache.reserve(G, [(other[1], PAGE)])


def test_truncate_returns_the_pages_past_the_length():
    cache = KVCache("cpu", 64 * G.page_bytes(PAGE), PAGE)
    a = SequenceKV()
    cache.reserve(G, [(a, 5)])
    cache.reserve(G, [(a, 6)])  # 11 keys, 3 pages
    cache.truncate(G, a, 5)
    assert (a.length, len(a.pages), cache.used_bytes) == (5, 2, 2 * G.page_bytes(PAGE))


def test_table_ids_limits_and_expiry():
    table = SessionTable(max_sessions=2, idle_s=10.0)
    assert len(table.new_id(None)) == 32
    for bad in ("", "attend", "...", "a/b", "x" * 129, "a b"):
        if bad:
            with pytest.raises(Exception, match="not valid"):
                check_session_id(bad)
    for good in ("a", "seq:1.2_3-x", "." * 2 + "a", "x" * 128):
        assert check_session_id(good) == good
    s1 = Session("s1", 0, G, [SequenceKV()], last_used=0.0)
    s2 = Session("s2", 0, G, [SequenceKV()], last_used=5.0, active=1)
    table.add(s1)
    table.add(s2)
    with pytest.raises(Conflict):
        table.new_id("s1")
    with pytest.raises(InsufficientStorage, match="--max-sessions 2"):
        table.add(Session("s3", 0, G, [SequenceKV()]))
    assert [s.id for s in table.idle(now=12.0)] == ["s1"]  # s2 is busy
    table.pop("s1")
    assert s1.ended
    with pytest.raises(NotFound, match="expired"):
        table.get("s1")


def test_step_validation():
    q = torch.zeros(1, 4, 3, 8)
    k = torch.zeros(1, 2, 3, 8)
    step = SessionStep.single("s", q, k, k.clone())
    assert step.q.shape == (3, 4, 8) and step.q_lengths == (3,) and step.causal
    bnhd = SessionStep.single("s", q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), layout="bnhd")
    assert bnhd.q.shape == (3, 4, 8) and bnhd.k.shape == (3, 2, 8)
    with pytest.raises(Exception, match="missing tensor v"):
        SessionStep.single("s", q, k, None)
    with pytest.raises(Exception, match="B = 1") as err:
        SessionStep.single("s", torch.zeros(2, 4, 3, 8))
    assert err.value.http_status == 422
    with pytest.raises(Exception, match="add up") as err:
        SessionStep.packed(["a", "b"], torch.zeros(5, 4, 8), None, None, [2, 2])
    assert err.value.http_status == 422
    with pytest.raises(Exception, match="at most once"):
        SessionStep.packed(["a", "a"], torch.zeros(4, 4, 8), None, None, [2, 2])
    packed = SessionStep.packed(["a", "b"], torch.zeros(5, 4, 8), None, None, torch.tensor([2, 3], dtype=torch.int32))
    assert packed.rows == [(0, 2), (2, 5)] and packed.layout is None


def test_a_kv_cache_of_a_gpu_worker_whole_budget_is_refused_at_start():
    """--kv-cache-mb at or past what a GPU worker may use after its warm-up would leave stateless
    requests nothing (413 for every call): the start stops with a message naming both sizes. No
    device is touched before the check (the cache allocates its pages lazily)."""
    from types import SimpleNamespace

    from service.core.metrics import Metrics
    from service.sessions.manager import SessionManager
    from service.settings import load_settings

    worker = SimpleNamespace(device=torch.device("cuda:0"), name="cuda:0", memory_budget=512 * 2**20)
    manager = SessionManager(load_settings(["--kv-cache-mb", "512"]), Metrics(), [worker])
    with pytest.raises(ValueError, match=r"--kv-cache-mb 512 is not below what worker cuda:0 may use .*512 MiB"):
        manager.start()
    assert worker.memory_budget == 512 * 2**20
