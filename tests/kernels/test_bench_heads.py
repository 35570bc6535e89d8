"""bench/kernels.py's heads section compares against SDPA, whose ``is_causal`` is top-left: for
Nq != Nk it must pass the lower-right bias, so that SDPA computes the kernels' own causal mask."""

from __future__ import annotations

import pytest
import torch

from bench.heads import _fn, head_table_rows
from kernels.reference import reference_attention


@pytest.mark.parametrize("n_q, n_k", [(5, 37), (37, 37), (40, 9)])
def test_sdpa_rows_use_the_kernels_bottom_right_causal(n_q, n_k, monkeypatch):
    from torch.nn.attention import SDPBackend

    import bench.heads as heads

    monkeypatch.setitem(heads.BACKENDS, "sdpa_flash", SDPBackend.MATH)  # the CPU's backend
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n_q, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n_k, 16, generator=g, dtype=torch.float64) for _ in range(2))
    got = _fn("sdpa_flash", n_q, n_k)(q, k, v, True)
    want, _ = reference_attention(q, k, v, causal=True, scale=16 ** -0.5)
    seen = torch.isfinite(got).all(-1)  # SDPA gives NaN where a row sees no key; the kernels give 0
    assert seen.any()
    assert torch.allclose(got[seen], want[seen], atol=1e-10)


def test_table_rows_give_ratios_and_skips():
    rows = head_table_rows([
        dict(dtype="bfloat16", shape="1x16/16x4096x4096", D=256, causal=True, flash=600, flash_triton=370,
             sdpa_cudnn=520, sdpa_flash="err", err=1e-3, flash_kernel="attn_fwd_ws"),
        dict(dtype="bfloat16", shape="1x16/16x4096x4096", D=96, causal=False, skipped="time")])
    assert rows[0][4:10] == [600, 370, 520, "err", "1.15", "1.62"]
    assert rows[1][4] == "skipped (time)" and len(rows[1]) == len(rows[0])
