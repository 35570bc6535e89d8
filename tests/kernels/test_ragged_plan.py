"""kernels.ragged.build_plan, built with numpy over every work item at once, against the plan's
definition written as the plain loop over sequences, row tiles and key splits: the same seq rows,
decode and prefill items (prefill longest first, stably), merge rows and partial-row count."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels import ragged


def plan_by_loop(q_lens, k_lens, k_starts, hq, hkv, d, dtype, causal, sms):
    cfg_d = ragged.kernel_config(True, d, dtype, False)
    cfg_p = ragged.kernel_config(False, d, dtype, False)
    seq_rows, dec, pre, pre_cost, merge = [], [], [], [], []
    part_rows, q0 = 0, 0
    for s, (n_q, n_k) in enumerate(zip(q_lens, k_lens, strict=True)):
        seq_rows.append((q0, n_q, 0 if k_starts is None else k_starts[s], n_k))
        if n_q > 0:
            decode, tiles, splits, kps = ragged.sequence_plan(n_q, n_k, hq, hkv, cfg_d.block_m, cfg_p.block_m, sms)
            base = -1
            if splits > 1:
                base, part_rows = part_rows, part_rows + splits * n_q
                merge.extend((q0 + i, base + i, n_q, splits) for i in range(n_q))
            for tile in range(tiles):
                for j in range(splits):
                    k0, k1 = j * kps, min(j * kps + kps, n_k)
                    item = (s, tile, k0, k1, base + j * n_q if splits > 1 else -1)
                    if decode:
                        dec.append(item)
                    else:
                        pre.append(item)
                        hi = min(k1, (tile + 1) * cfg_p.block_m + n_k - n_q) if causal else k1
                        pre_cost.append(k0 - hi)
        q0 += n_q
    if pre:
        pre = [pre[i] for i in np.argsort(np.asarray(pre_cost), kind="stable")]

    def arr(rows, width):
        return np.asarray(rows, dtype=np.int32).reshape(-1, width)

    return arr(seq_rows, 4), arr(dec, 5), arr(pre, 5), arr(merge, 4), part_rows


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


@pytest.mark.parametrize("sms", [16, 132])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(32, 8), (4, 4), (8, 1)])
def test_build_plan_equals_the_loop(monkeypatch, sms, causal, heads):
    monkeypatch.setattr(ragged, "num_sms", lambda device: sms)
    hq, hkv = heads
    for q_lens, k_lens, starts in cases():
        plan = ragged.build_plan(q_lens, k_lens, starts, hq, hkv, 128, torch.bfloat16, torch.device("cpu"),
                                 causal, False)
        seq, dec, pre, merge, part_rows = plan_by_loop(q_lens, k_lens, starts, hq, hkv, 128, torch.bfloat16,
                                                       causal, sms)
        for name, got, want in (("seq", plan.seq, seq), ("decode", plan.decode, dec), ("prefill", plan.prefill, pre),
                                ("merge", plan.merge, merge)):
            assert np.array_equal(got.numpy(), want), (name, q_lens, k_lens)
        assert plan.part_rows == part_rows
