"""bench/seed.py's arithmetic: the seed's byte counts and the reading of ncu's CSV."""
# ruff: noqa: E501 - ncu's CSV lines are as long as ncu writes them

from __future__ import annotations

import pytest

from bench import seed

NCU_CSV = """==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3","h","matmul","1","7","Command line profiler metrics","dram__bytes_read.sum","Mbyte","1,024.50"
"0","123","python3","h","matmul","1","7","Command line profiler metrics","dram__bytes_write.sum","Kbyte","512"
"1","123","python3","h","softmax","1","7","Command line profiler metrics","dram__bytes_read.sum","byte","100"
"1","123","python3","h","softmax","1","7","Command line profiler metrics","dram__bytes_write.sum","Gbyte","2"
==PROF== Disconnected from process 123
"""


def test_ncu_rows_sum_over_kernels_in_their_units():
    read, write, kernels = seed.parse_ncu_csv(NCU_CSV)
    assert read == pytest.approx(1024.5e6 + 100)
    assert write == pytest.approx(512e3 + 2e9)
    assert kernels == 2


def test_ncu_without_rows_says_none():
    assert seed.parse_ncu_csv("==ERROR== Failed to initialize the profiler\n") is None


def test_the_seeds_counts():
    n, m = 1024, 116224
    got = seed.theory_bytes(n, m)
    bh = seed.B * seed.H * seed.ELEM
    assert got["standard_theory"] == bh * (4 * n * n + 4 * n * seed.D)
    assert got["flash_seed_bound"] == pytest.approx(bh * n * n * seed.D ** 2 / m)
    # doubling N: standard and the bound grow 4x; the tile count a little less (its Nd term)
    big = seed.theory_bytes(2 * n, m)
    assert big["flash_seed_bound"] == pytest.approx(4 * got["flash_seed_bound"])
    assert 3.5 < big["standard_theory"] / got["standard_theory"] < 4
