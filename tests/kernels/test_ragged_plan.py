"""kernels.ragged.build_plan, listed in plain Python (small plans) and with numpy over every work
item at once (large ones), against the plan's definition written as the plain loop over sequences,
row tiles and key splits: the same seq rows, decode, prefill and chunk items (prefill and chunk
longest first, stably), merge rows and partial-row count."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels import ragged


def plan_by_loop(q_lens, k_lens, k_starts, hq, hkv, d, dtype, causal, sms):
    cfgs = [ragged.kernel_config(c, d, dtype, False) for c in ragged.CLASSES]
    block_ms = tuple(c.block_m for c in cfgs)
    seq_rows, merge = [], []
    work = [[] for _ in ragged.CLASSES]
    cost = [[] for _ in ragged.CLASSES]
    part_rows, q0 = 0, 0
    for s, (n_q, n_k) in enumerate(zip(q_lens, k_lens, strict=True)):
        seq_rows.append((q0, n_q, 0 if k_starts is None else k_starts[s], n_k))
        if n_q > 0:
            cls, tiles, splits, kps = ragged.sequence_plan(n_q, n_k, hq, hkv, block_ms, sms)
            assert cls == ragged.sequence_class(n_q, n_k, hq // hkv)
            base = -1
            if splits > 1:
                base, part_rows = part_rows, part_rows + splits * n_q
                merge.extend((q0 + i, base + i, n_q, splits) for i in range(n_q))
            for tile in range(tiles):
                for j in range(splits):
                    k0, k1 = j * kps, min(j * kps + kps, n_k)
                    work[cls].append((s, tile, k0, k1, base + j * n_q if splits > 1 else -1))
                    hi = min(k1, (tile + 1) * block_ms[cls] + n_k - n_q) if causal else k1
                    cost[cls].append(k0 - hi)
        q0 += n_q
    for c in (1, 2):  # prefill and chunk items: longest first, stably
        if work[c]:
            work[c] = [work[c][i] for i in np.argsort(np.asarray(cost[c]), kind="stable")]

    def arr(rows, width):
        return np.asarray(rows, dtype=np.int32).reshape(-1, width)

    return arr(seq_rows, 4), *(arr(w, 5) for w in work), arr(merge, 4), part_rows


def cases():
    rng = random.Random(0)
    yield [1] * 64, [1024 + 500 * i for i in range(64)], None  # a decode step of many long sequences
    yield [0, 1, 3], [0, 1, 0], None                             # empty, keyless
    yield [], [], None                                           # no sequence at all
    for _ in range(30):
        s = rng.randint(1, 12)
        q = [rng.choice([0, 1, 2, 5, 17, 64, 65, 300, 1025]) for _ in range(s)]
        k = [n + rng.choice([0, 0, 3, 255, 256, 2000, 9000]) for n in q]
        starts = [rng.randint(0, 50) for _ in range(s)] if rng.random() < 0.5 else None
        yield q, k, starts


@pytest.mark.parametrize("small", [0, 256, 10**9], ids=["numpy", "default", "lists"])
@pytest.mark.parametrize("seqs", [0, 16], ids=["numpy_plans", "default_plans"])
@pytest.mark.parametrize("sms", [16, 132])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(32, 8), (4, 4), (8, 1)])
def test_build_plan_equals_the_loop(monkeypatch, small, seqs, sms, causal, heads):
    monkeypatch.setattr(ragged, "num_sms", lambda device: sms)
    monkeypatch.setattr(ragged, "SMALL_PLAN_ITEMS", small)  # 0: always numpy; 10**9: always lists
    monkeypatch.setattr(ragged, "SMALL_PLAN_SEQS", seqs)  # 0: every sequence's plan by sequence_plans
    hq, hkv = heads
    for q_lens, k_lens, starts in cases():
        plan = ragged.build_plan(q_lens, k_lens, starts, hq, hkv, 128, torch.bfloat16, torch.device("cpu"),
                                 causal, False)
        seq, dec, pre, chunk, merge, part_rows = plan_by_loop(q_lens, k_lens, starts, hq, hkv, 128,
                                                              torch.bfloat16, causal, sms)
        for name, got, want in (("seq", plan.seq, seq), ("decode", plan.decode, dec), ("prefill", plan.prefill, pre),
                                ("chunk", plan.chunk, chunk), ("merge", plan.merge, merge)):
            assert np.array_equal(got.numpy(), want), (name, q_lens, k_lens)
        assert plan.part_rows == part_rows


@pytest.mark.parametrize("heads", [(32, 8), (4, 4), (8, 1), (64, 2)])
@pytest.mark.parametrize("sms", [16, 132])
def test_sequence_plans_is_sequence_plan_at_once(heads, sms):
    """Every (n_q, n_k) of a grid around the class, split and quantum bounds: numpy's plan of all
    of them at once is each one's own."""
    hq, hkv = heads
    block_ms = (16, 128, 64)
    qs = [0, 1, 2, 3, 7, 8, 9, 16, 17, 63, 64, 65, 127, 128, 129, 300]
    ks = [0, 1, 255, 256, 511, 512, 513, 767, 768, 4095, 4096, 4352, 4353, 16385, 70000]
    grid = [(q, q + k) for q in qs for k in ks]
    got = ragged.sequence_plans(np.asarray([g[0] for g in grid]), np.asarray([g[1] for g in grid]), hq, hkv,
                                block_ms, sms)
    for i, (n_q, n_k) in enumerate(grid):
        want = ragged.sequence_plan(n_q, n_k, hq, hkv, block_ms, sms) if n_q else (1, 0, 1, 0)
        assert tuple(int(a[i]) for a in got) == want, (n_q, n_k)


@pytest.mark.parametrize("sms", [16, 132])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)])
def test_decode_steps_reuse_a_template_and_equal_the_loop(sms, heads, monkeypatch):
    """A decode step of many growing sequences writes its key counts into the plan of the step
    before (``_decode_template``): step after step, across split, quantum and no-split bounds and
    with rows of 1 to 8 a sequence, the plan equals the loop's, and later steps reuse the template."""
    monkeypatch.setattr(ragged, "num_sms", lambda device: sms)
    hq, hkv = heads
    rng = random.Random(1)
    n = 40
    q_lens = [rng.choice([1, 1, 2, 8]) if hq // hkv <= 8 else 1 for _ in range(n)]
    k_lens = [rng.choice([1, 200, 255, 511, 512, 767, 4095, 16383, 70000]) + q for q in q_lens]
    ragged._decode_template.cache_clear()
    for _ in range(12):
        plan = ragged.build_plan(q_lens, k_lens, None, hq, hkv, 128, torch.bfloat16, torch.device("cpu"), False, False)
        want = plan_by_loop(q_lens, k_lens, None, hq, hkv, 128, torch.bfloat16, False, sms)
        for name, got, exp in zip(("seq", "decode", "prefill", "chunk", "merge"),
                                  (plan.seq, plan.decode, plan.prefill, plan.chunk, plan.merge), want[:5], strict=True):
            assert np.array_equal(got.numpy(), exp), (name, k_lens)
        assert plan.part_rows == want[5]
        k_lens = [k + rng.choice([1, 1, 2]) for k in k_lens]
    info = ragged._decode_template.cache_info()
    assert info.hits >= 6 and info.misses >= 1, info
