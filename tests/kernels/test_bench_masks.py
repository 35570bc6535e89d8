"""bench/kernels.py's masks section counts FLOPs over the visible score entries only: its pair
count must be the kernels' own mask (kernels/masks.py ``visible``), and its ALiBi slopes the
geometric ones."""

from __future__ import annotations

import pytest
import torch

from bench.masks import alibi_slopes, mask_rows, visible_pairs, window_sides
from kernels.masks import Masks, visible


@pytest.mark.parametrize("n_q, n_k", [(64, 64), (40, 64), (64, 40), (1, 33)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (7, 0), (0, 0), (5, 9), (-1, 3), (12, -1), (100, 100)])
def test_visible_pairs_is_the_kernels_mask(n_q, n_k, causal, window):
    left, right = window
    masks = Masks(left, -1 if causal else right)  # check_masks drops the right side with causal
    mask = visible(torch.arange(n_q), torch.arange(n_k), n_q, n_k, causal, masks)
    want = n_q * n_k if mask is None else int(mask.sum())
    assert visible_pairs(n_q, n_k, causal, window) == want


def test_window_of_w_keys_sees_w_keys_per_full_row():
    n = 8192
    for w in (256, 1024, 4096):
        # causal (w - 1, 0): row i sees min(i + 1, w) keys
        assert visible_pairs(n, n, True, window_sides(w, True)) == sum(min(i + 1, w) for i in range(n))
        # (w/2, w/2): w + 1 keys per row away from the ends
        left, right = window_sides(w, False)
        assert (left, right) == (w // 2, w // 2)
        assert visible_pairs(n, n, False, (left, right)) == sum(
            min(n - 1, i + right) - max(0, i - left) + 1 for i in range(n))
    assert visible_pairs(n, n, True) == n * (n + 1) // 2


def test_alibi_slopes_are_geometric():
    assert alibi_slopes(8) == pytest.approx([2.0 ** -(h + 1) for h in range(8)])
    s32 = alibi_slopes(32)
    assert s32[0] == pytest.approx(2 ** -0.25) and s32[-1] == pytest.approx(2 ** -8)
    # not a power of two: the 8-head set, then every other slope of the 16-head set
    assert alibi_slopes(12) == pytest.approx(alibi_slopes(8) + alibi_slopes(16)[0::2][:4])


def test_mask_rows():
    names = [r[0] for r in mask_rows()]
    assert names.count("window 1024") == 2 and "softcap" in names and "alibi" in names
    assert "window 1024 + softcap" in names
    assert all(r[3] == 0 and not r[4] for r in mask_rows(which="window"))
