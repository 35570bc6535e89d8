"""attention_paged and append_paged (docs/api.md#ragged-and-paged-batches): keys in shuffled, shared,
partly filled pages.

Every free slot of the pages is NaN (``ragged_cases.paginate``), so a read past a sequence's
cache_lens, or through a block-table entry past its last page, shows up as NaN in o. Interpreter
sizes are tiny; the ``gpu`` tests add bfloat16, 64k keys and 256 sequences.
"""

from __future__ import annotations

import math

import pytest
import torch
from ragged_cases import DEV, check_sequences, cu_of, nan_empty, paginate, randn

from kernels import (
    BlockTableError,
    DTypeError,
    KernelUnavailableError,
    SeqLensError,
    ShapeError,
    append_paged,
    attention_paged,
    attention_varlen,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
KERNELS = ["flash", "reference"]

# name: (q_lens, cache_lens, page_tokens, Hq, Hkv, D, causal, shared prefix pages) — a reason for each odd value
CASES = {
    "decode_page16": ([1, 1, 1], [1, 17, 600], 16, 8, 2, 64, True, 0),     # 1 key; a partial page; split keys
    "page1": ([1, 3], [5, 40], 1, 4, 4, 40, True, 0),                      # one token a page: a lookup per key
    "page17_mqa": ([2, 17], [17, 97], 17, 5, 1, 72, True, 0),              # odd pages smaller than BLOCK_N, MQA
    "page64_chunk": ([65, 1], [200, 130], 64, 4, 4, 128, True, 0),         # chunked prefill rows, then a decode
    "page256_noncausal": ([3, 0, 2], [300, 0, 2], 256, 4, 2, 40, False, 0),  # an empty sequence; one partial page
    "shared_prefix": ([1, 4], [100, 70], 16, 4, 2, 64, True, 4),           # sequence 1 reads 0's first 4 pages
    "d256": ([2], [70], 16, 2, 2, 256, True, 0),                           # the largest head dim
    "rows_past_keys": ([5, 7, 3], [2, 0, 3], 16, 4, 2, 32, True, 0),        # a q-only step: more rows than keys
    "rows_past_keys_full": ([5, 7], [2, 0], 16, 4, 2, 32, False, 0),       # ... against an encoder's keys
}
FP16 = ["decode_page16", "page17_mqa", "shared_prefix"]
GPU_ONLY = {
    "long_64k": ([1, 1], [65536, 1025], 64, 32, 8, 128, True, 0),          # 64k keys, split and merged
    "page256_chunk": ([1025, 97], [4096, 97], 256, 32, 8, 128, True, 0),  # a 1025-row chunk against 4k keys
    "page16_d40": ([1, 17, 97], [1025, 17, 1024], 16, 8, 2, 40, False, 0),
    # paged_decode (Gluon; pages of a multiple of 64): two row tiles (8 rows x group 4), a step as long
    # as its keys, a partial page; D 64 non-causal with four tiles; q-only rows and an empty sequence
    "gluon_rows": ([8, 3, 1], [4100, 3, 70], 64, 32, 8, 128, True, 0),
    "gluon_d64": ([1, 5, 16], [1000, 129, 64], 128, 16, 4, 64, False, 0),
    "gluon_q_only": ([4, 1, 2], [2, 0, 300], 64, 8, 2, 128, True, 0),
    # ragged_prefill (Gluon): 128-row tiles over pages of 64 (64-key blocks) beside a decode, a
    # sequence as long as its rows, rows past their keys; a 40-row chunk split along its 6000 keys
    # (partials and merge), D 96 padded to 128; D 256 non-causal
    "gluon_prefill_p64": ([300, 64, 1, 130], [5000, 64, 1000, 129], 64, 32, 8, 128, True, 0),
    "gluon_split_d96": ([40, 200], [6000, 2000], 128, 16, 4, 96, True, 0),
    "gluon_d256_full": ([150, 70], [700, 3000], 64, 8, 8, 256, False, 0),
    # pages smaller than a block, a TMA copy per page: decode items split over pages of 16, keys
    # fewer than one page, a prefill of 128-key blocks of 8 pages; pages of 32 at D 64
    "gluon_page16": ([1, 4, 1, 300], [8193, 77, 15, 2000], 16, 32, 8, 128, True, 0),
    "gluon_page32_d64": ([2, 1, 70], [1000, 33, 200], 32, 16, 4, 64, False, 0),
}
GLUON = ["gluon_rows", "gluon_d64", "gluon_q_only", "long_64k", "gluon_page16", "gluon_page32_d64"]
GLUON_PREFILL = ["gluon_prefill_p64", "gluon_split_d96", "gluon_d256_full", "page256_chunk", "page64_chunk",
                 "gluon_page16"]


def make_cache(case, dtype, seed=0, device=DEV):
    """q, pages, table, cache_lens, cu_seqlens_q and each sequence's contiguous k, v."""
    q_lens, lens, page, hq, hkv, d, causal, shared = case
    g = torch.Generator().manual_seed(seed)
    k_seqs = [randn(g, n, hkv, d, dtype=dtype, device=device) for n in lens]
    v_seqs = [randn(g, n, hkv, d, dtype=dtype, device=device) for n in lens]
    if shared:
        m = shared * page
        k_seqs[1][:m], v_seqs[1][:m] = k_seqs[0][:m], v_seqs[0][:m]
    k_pages, v_pages, table = paginate(k_seqs, v_seqs, page, seed, share_prefix_pages=shared)
    q = randn(g, sum(q_lens), hq, d, dtype=dtype, device=device)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_pages, v_pages, table, cache_lens, cu_of(q_lens, device), k_seqs, v_seqs


def run_case(case, dtype, kernel):
    q_lens, _, _, _, _, d, causal, _ = case
    q, kp, vp, table, lens, cu_q, k_seqs, v_seqs = make_cache(case, dtype)
    o, lse = attention_paged(q, kp, vp, table, lens, cu_q, causal=causal, return_lse=True, kernel=kernel)
    check_sequences(o, lse, q, k_seqs, v_seqs, q_lens, causal=causal, scale=d ** -0.5)
    return o, lse


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_paged_fp32(name, kernel, monkeypatch):
    nan_empty(monkeypatch)
    run_case(CASES[name], torch.float32, kernel)


@pytest.mark.parametrize("name", FP16)
def test_paged_fp16(name, monkeypatch):
    nan_empty(monkeypatch)
    run_case(CASES[name], torch.float16, "flash")


@pytest.mark.parametrize("kernel", KERNELS)
def test_paged_equals_varlen(kernel):
    """The same keys paged or contiguous: the same plan and kernel, so the same bits."""
    case = CASES["page17_mqa"]
    lens = case[1]
    q, kp, vp, table, cl, cu_q, k_seqs, v_seqs = make_cache(case, torch.float32)
    o, lse = attention_paged(q, kp, vp, table, cl, cu_q, return_lse=True, kernel=kernel)
    o2, lse2 = attention_varlen(q, torch.cat(k_seqs), torch.cat(v_seqs), cu_q, cu_of(lens), causal=True,
                                return_lse=True, kernel=kernel)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_paged_batch_invariance(kernel):
    """Each sequence's rows bit-equal to the sequence alone (with its own table row)."""
    case = ([1, 5, 0, 1, 40], [600, 20, 3, 9, 70], 16, 4, 2, 40, True, 0)
    q_lens = case[0]
    q, kp, vp, table, cl, cu_q, _, _ = make_cache(case, torch.float32, seed=5)
    o, lse = attention_paged(q, kp, vp, table, cl, cu_q, return_lse=True, kernel=kernel)
    at = 0
    for s, n in enumerate(q_lens):
        o1, l1 = attention_paged(q[at:at + n], kp, vp, table[s:s + 1], cl[s:s + 1], cu_of([n]), return_lse=True,
                                 kernel=kernel)
        assert torch.equal(o[at:at + n], o1) and torch.equal(lse[:, at:at + n], l1), f"sequence {s}"
        at += n


@pytest.fixture
def block_n16(monkeypatch):
    """The interpreter's tiles with 16-key blocks (its default streams 32), so that pages of 16
    take the one-entry-a-block path too; the plan cache is cleared around the change."""
    from kernels import ragged

    real = ragged.kernel_config

    def config(cls, d, dtype, interpret, gluon=False):
        cfg = real(cls, d, dtype, interpret, gluon)
        return ragged.Config(cfg.block_m, 16, cfg.num_warps, cfg.num_stages)

    ragged.cached_plan.cache_clear()
    monkeypatch.setattr(ragged, "kernel_config", config)
    yield
    ragged.cached_plan.cache_clear()


def page_block_case(page):
    """A split decode (600 keys), a causal chunk of 33 rows whose first 64 keys are sequence 0's
    (shared pages), and one exactly full 64-key page; every page shuffled, free slots NaN."""
    return ([1, 33, 1], [600, 200, 64], page, 4, 2, 64, True, 64 // page)


def check_page_block(pages, block_n):
    from kernels import ragged

    outs = []
    for page in pages:
        assert ragged.page_block(block_n, page) == (page % block_n == 0)
        case = page_block_case(page)
        q, kp, vp, table, cl, cu_q, k_seqs, v_seqs = make_cache(case, torch.float32)
        o, lse = attention_paged(q, kp, vp, table, cl, cu_q, return_lse=True, kernel="flash")
        check_sequences(o, lse, q, k_seqs, v_seqs, case[0], causal=True, scale=64 ** -0.5)
        outs.append((o, lse))
    o2, lse2 = attention_varlen(q, torch.cat(k_seqs), torch.cat(v_seqs), cu_q, cu_of(case[1]), causal=True,
                                return_lse=True, kernel="flash")
    for page, (o, lse) in zip(pages, outs, strict=True):  # one table entry a block or per key: the same bits
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"page {page}"


def test_paged_page_block(monkeypatch):
    """Pages of 64 (a multiple of the interpreter's 32-key blocks: one table entry a block) equal
    pages of 1 and 16 (a lookup per key) and contiguous keys bit for bit."""
    nan_empty(monkeypatch)
    check_page_block([64, 1, 16], 32)


def test_paged_page_block_16(block_n16, monkeypatch):
    """With 16-key blocks, pages of 16 and 64 read one entry a block; pages of 1 per key."""
    nan_empty(monkeypatch)
    check_page_block([16, 64, 1], 16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """NaN-proof bitwise view (poisoned slots are NaN, and NaN != NaN)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("page", [1, 16, 17])
def test_append_then_attend(kernel, page):
    """append_paged writes exactly the new slots (every other byte of the pages unchanged), and
    attending after it equals attending over the concatenated keys."""
    old, new, q_lens = [5, 40, 0, 16], [1, 3, 2, 0], [1, 3, 2, 0]
    hq, hkv, d = 4, 2, 40
    g = torch.Generator().manual_seed(7)
    full_k = [randn(g, a + b, hkv, d, dtype=torch.float32) for a, b in zip(old, new, strict=True)]
    full_v = [randn(g, a + b, hkv, d, dtype=torch.float32) for a, b in zip(old, new, strict=True)]
    # the table covers the appended length; the pages hold only the old keys (the rest NaN)
    kp, vp, table = paginate(full_k, full_v, page, seed=7)
    for s, (a, b) in enumerate(zip(old, new, strict=True)):
        for j in range(a, a + b):
            kp[table[s, j // page], j % page] = float("nan")
            vp[table[s, j // page], j % page] = float("nan")
    before_k, before_v = kp.clone(), vp.clone()
    k_new = torch.cat([k[a:] for k, a in zip(full_k, old, strict=True)])
    v_new = torch.cat([v[a:] for v, a in zip(full_v, old, strict=True)])
    cl = torch.tensor(old, dtype=torch.int32, device=DEV)
    append_paged(kp, vp, table, cl, k_new, v_new, cu_of(new), kernel=kernel)
    assert cl.tolist() == old, "cache_lens is not changed"
    written = torch.zeros(kp.shape[:2], dtype=torch.bool, device=kp.device)
    for s, (a, b) in enumerate(zip(old, new, strict=True)):
        for j in range(a, a + b):
            written[table[s, j // page], j % page] = True
            assert torch.equal(kp[table[s, j // page], j % page], full_k[s][j])
            assert torch.equal(vp[table[s, j // page], j % page], full_v[s][j])
    assert torch.equal(bits(kp[~written]), bits(before_k[~written])), "a slot outside the new rows changed"
    assert torch.equal(bits(vp[~written]), bits(before_v[~written]))
    lens = [a + b for a, b in zip(old, new, strict=True)]
    q = randn(g, sum(q_lens), hq, d, dtype=torch.float32)
    o, lse = attention_paged(q, kp, vp, table, cl + torch.tensor(new, dtype=torch.int32, device=DEV), cu_of(q_lens),
                             return_lse=True, kernel=kernel)
    o2, lse2 = attention_varlen(q, torch.cat(full_k), torch.cat(full_v), cu_of(q_lens), cu_of(lens), causal=True,
                                return_lse=True, kernel=kernel)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_append_untouched_pages_flash_equals_reference():
    """The Triton append (interpreter here) and index_put write the same bytes."""
    case = CASES["shared_prefix"]
    _, kp, vp, table, cl, _, _, _ = make_cache(case, torch.float16)
    g = torch.Generator().manual_seed(2)
    # room for 20 more keys in each sequence: widen the table with fresh pages
    extra = torch.arange(kp.shape[0], kp.shape[0] + 4, dtype=torch.int32, device=DEV).view(2, 2)
    kp = torch.cat([kp, torch.full((4, *kp.shape[1:]), float("nan"), dtype=kp.dtype, device=DEV)])
    vp = torch.cat([vp, torch.full_like(kp[-4:], float("nan"))])
    need = [math.ceil(n / 16) for n in cl.tolist()]
    table = table.clone()
    for s in range(2):
        table[s, need[s]:need[s] + 2] = extra[s]
    k_new = randn(g, 30, 2, 64, dtype=torch.float16)
    v_new = randn(g, 30, 2, 64, dtype=torch.float16)
    outs = []
    for kernel in KERNELS:
        a, b = kp.clone(), vp.clone()
        append_paged(a, b, table, cl, k_new, v_new, cu_of([10, 20]), kernel=kernel)
        outs.append((bits(a), bits(b)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _paged_args(**change):
    q, kp, vp, table, cl, cu_q, _, _ = make_cache(([1, 2], [20, 5], 16, 4, 2, 16, True, 0), torch.float32)
    args = dict(q=q, k_pages=kp, v_pages=vp, block_table=table, cache_lens=cl, cu_seqlens_q=cu_q)
    args.update({name: fn(args) for name, fn in change.items()})
    return args


def idx(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def with_column(table, col, value):
    table = table.clone()
    table[:, col] = value
    return table


PAGED_BAD = {  # name: (change, error, message fragment)
    "pages_3d": (dict(k_pages=lambda a: a["k_pages"][0], v_pages=lambda a: a["v_pages"][0]), ShapeError, "4 dims"),
    "pages_dtype": (dict(v_pages=lambda a: a["v_pages"].half()), DTypeError, "one dtype"),
    "pages_differ": (dict(v_pages=lambda a: a["v_pages"][:-1]), ShapeError, "same shape"),
    "table_int64": (dict(block_table=lambda a: a["block_table"].long()), BlockTableError, "int32"),
    "table_rows": (dict(block_table=lambda a: a["block_table"][:1]), SeqLensError, "S = 2"),
    "table_short": (dict(block_table=lambda a: a["block_table"][:, :1]), BlockTableError, "needs 2 pages"),
    "page_out_of_range": (dict(block_table=lambda a: with_column(a["block_table"], 0, 999)),
                          BlockTableError, "names no page"),
    "page_negative": (dict(block_table=lambda a: with_column(a["block_table"], 1, -1)),
                      BlockTableError, r"block_table\[0, 1\] = -1 names no page"),
    "cache_lens_int64": (dict(cache_lens=lambda a: a["cache_lens"].long()), SeqLensError, "int32"),
    "cache_lens_negative": (dict(cache_lens=lambda a: idx([20, -1])), SeqLensError, ">= 0"),
    "cu_end": (dict(cu_seqlens_q=lambda a: idx([0, 1, 2])), SeqLensError, "end at"),
    "q_heads": (dict(q=lambda a: a["q"][:, :3]), ShapeError, "multiple"),
}


@pytest.mark.parametrize("name", sorted(PAGED_BAD))
def test_paged_bad_inputs(name):
    change, error, fragment = PAGED_BAD[name]
    with pytest.raises(error, match=fragment):
        attention_paged(**_paged_args(**change))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["decode_page16", "page64_chunk", "page256_noncausal", "shared_prefix"])
def test_paged_host_index_gives_the_device_paths_bits(name, kernel):
    """The lengths and table given on the host as well (``host_index``, what a KV cache keeps) give
    the bits of the call that reads them from the device, batched and each sequence alone."""
    q_lens, causal = CASES[name][0], CASES[name][6]
    q, kp, vp, table, cl, cu_q, _, _ = make_cache(CASES[name], torch.float32, seed=7)
    o, lse = attention_paged(q, kp, vp, table, cl, cu_q, causal=causal, return_lse=True, kernel=kernel)
    o2, lse2 = attention_paged(q, kp, vp, table, cl, cu_q, causal=causal, return_lse=True, kernel=kernel,
                               host_index=(cu_q.cpu(), cl.cpu(), table.cpu()))
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    at = 0
    for s, n in enumerate(q_lens):
        one = (cu_of([n], "cpu"), cl[s:s + 1].cpu(), table[s:s + 1].cpu())
        o1, l1 = attention_paged(q[at:at + n], kp, vp, table[s:s + 1], cl[s:s + 1], cu_of([n]), causal=causal,
                                 return_lse=True, kernel=kernel, host_index=one)
        assert torch.equal(o[at:at + n], o1) and torch.equal(lse[:, at:at + n], l1), f"sequence {s}"
        at += n


def test_paged_host_index_is_checked():
    """host_index is checked as the device tensors are: its page indices, its lengths, its shapes."""
    args = _paged_args()
    cu_q, cl, table = args["cu_seqlens_q"].cpu(), args["cache_lens"].cpu(), args["block_table"].cpu()
    with pytest.raises(BlockTableError, match="names no page"):
        attention_paged(**args, host_index=(cu_q, cl, with_column(table, 0, 999)))
    with pytest.raises(BlockTableError, match=r"block_table\[0, 1\] = -1 names no page"):
        attention_paged(**args, host_index=(cu_q, cl, with_column(table, 1, -1)))
    # past 16 sequences the entries are checked at once: the same errors
    n = 20
    many = dict(args, q=args["q"][:1].repeat(n, 1, 1), cu_seqlens_q=idx(list(range(n + 1))),
                cache_lens=idx([1] * n), block_table=table[:1].repeat(n, 1).to(args["block_table"].device))
    host_many = (many["cu_seqlens_q"].cpu(), many["cache_lens"].cpu(), many["block_table"].cpu())
    attention_paged(**many, host_index=host_many)  # every entry read names a page
    bad_table = host_many[2].clone()
    bad_table[17, 0] = -3
    with pytest.raises(BlockTableError, match=r"block_table\[17, 0\] = -3 names no page"):
        attention_paged(**many, host_index=(host_many[0], host_many[1], bad_table))
    with pytest.raises(SeqLensError, match=">= 0"):
        attention_paged(**args, host_index=(cu_q, idx([20, -1]).cpu(), table))
    with pytest.raises(SeqLensError, match="shape"):
        attention_paged(**args, host_index=(cu_q[:2], cl, table))
    with pytest.raises(SeqLensError, match="host_index"):
        attention_paged(**args, host_index=(cu_q, cl))


APPEND_BAD = {
    "new_heads": (dict(k_new=lambda a: a["k_new"][:, :1], v_new=lambda a: a["v_new"][:, :1]), ShapeError, "match"),
    "new_dtype": (dict(k_new=lambda a: a["k_new"].half()), DTypeError, "dtype"),
    "cu_int64": (dict(cu_seqlens_new=lambda a: a["cu_seqlens_new"].long()), SeqLensError, "int32"),
    "cu_end": (dict(cu_seqlens_new=lambda a: idx([0, 1, 2])), SeqLensError, "end at"),
    "table_short": (dict(cache_lens=lambda a: idx([63, 0])), BlockTableError, "after the append"),
    "page_out_of_range": (dict(block_table=lambda a: with_column(a["block_table"], 1, -5)),
                          BlockTableError, "names no page"),
}


@pytest.mark.skipif(DEV == "cuda", reason="append_paged checks indices on the CPU only (no device sync)")
@pytest.mark.parametrize("name", sorted(APPEND_BAD))
def test_append_bad_inputs(name):
    change, error, fragment = APPEND_BAD[name]
    kp, vp, table = paginate([torch.zeros(20, 2, 16), torch.zeros(5, 2, 16)],
                             [torch.zeros(20, 2, 16), torch.zeros(5, 2, 16)], 16)
    args = dict(k_pages=kp, v_pages=vp, block_table=table, cache_lens=idx([17, 5]), k_new=torch.ones(3, 2, 16),
                v_new=torch.ones(3, 2, 16), cu_seqlens_new=idx([0, 2, 3]))
    args.update({k: fn(args) for k, fn in change.items()})
    with pytest.raises(error, match=fragment):
        append_paged(**args)


def test_paged_kernel_choice(monkeypatch):
    args = _paged_args()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if DEV == "cpu":
        with pytest.raises(KernelUnavailableError, match="CUDA"):
            attention_paged(**args, kernel="flash")
    with pytest.raises(KernelUnavailableError, match="flash_v1"):
        attention_paged(**args, kernel="flash_v1")


# ---- GPU ----

# Every case in bfloat16; float16 and float32 (its own tiles) on cases covering decode (split),
# chunked prefill, a lookup per key (page 16/17 < BLOCK_N 64), one a block (page 64) and D 256:
# each distinct kernel config (PAGE, D, class, dtype) compiles once or twice.
GPU_FP32 = ["d256", "decode_page16", "page64_chunk"]
GPU_RUNS = ([(name, torch.bfloat16) for name in sorted(CASES) + sorted(GPU_ONLY)]
            + [(name, torch.float16) for name in FP16 + ["gluon_d64"]]
            + [(name, torch.float32) for name in GPU_FP32])


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "dtype"), GPU_RUNS)
def test_paged_gpu(name, dtype, monkeypatch):
    nan_empty(monkeypatch)
    run_case({**CASES, **GPU_ONLY}[name], dtype, "flash")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GLUON)
def test_paged_gpu_gluon_decode(name, monkeypatch):
    """The decode items of these cases run paged_decode (Gluon), and with it off ragged_fwd: both
    within the budget of float64, on poisoned outputs and NaN in every free page slot."""
    from kernels import ragged

    nan_empty(monkeypatch)
    case = GPU_ONLY[name]
    q, kp, vp, *_ = make_cache(case, torch.bfloat16)
    assert ragged.gluon_decode_refusal(q, kp, vp, True, ragged.kernel_config("decode", q.shape[-1], q.dtype, False)) \
        is None
    o_gluon, lse_gluon = run_case(case, torch.bfloat16, "flash")
    monkeypatch.setattr(ragged, "GLUON_DECODE", False)
    o_triton, lse_triton = run_case(case, torch.bfloat16, "flash")
    assert (o_gluon.float() - o_triton.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", GLUON_PREFILL)
def test_paged_gpu_gluon_prefill(name, monkeypatch):
    """The prefill and chunk items of these cases run ragged_prefill (Gluon), and with it off
    ragged_fwd: both within the budget of float64, on poisoned outputs and NaN in every free slot."""
    from kernels import ragged

    nan_empty(monkeypatch)
    case = {**CASES, **GPU_ONLY}[name]
    q, kp, vp, *_ = make_cache(case, torch.bfloat16)
    cfg = ragged.kernel_config("chunk", q.shape[-1], q.dtype, False, True)
    assert ragged.gluon_prefill_refusal(q, kp, vp, True, cfg) is None
    o_gluon, _ = run_case(case, torch.bfloat16, "flash")
    monkeypatch.setattr(ragged, "GLUON_PREFILL", False)
    o_triton, _ = run_case(case, torch.bfloat16, "flash")
    assert (o_gluon.float() - o_triton.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("page", "dtype"), [(16, torch.bfloat16), (64, torch.bfloat16), (256, torch.float16)])
def test_paged_gpu_256_sequences_batch_invariant(page, dtype, monkeypatch):
    """256 decodes and chunks of mixed lengths in one launch, poisoned outputs; each sequence
    bit-equal to itself alone; within the error budget of float64."""
    nan_empty(monkeypatch)
    g = torch.Generator().manual_seed(page)
    lens = torch.randint(1, 9000, (256,), generator=g).tolist()
    q_lens = [1] * 224 + torch.randint(2, 300, (32,), generator=g).tolist()
    lens = [max(n, nq) for n, nq in zip(lens, q_lens, strict=True)]
    case = (q_lens, lens, page, 32, 8, 128, True, 0)
    q, kp, vp, table, cl, cu_q, k_seqs, v_seqs = make_cache(case, dtype)
    o, lse = attention_paged(q, kp, vp, table, cl, cu_q, return_lse=True)
    starts = cu_q.tolist()
    for s in list(range(0, 256, 17)) + [255]:
        a, b = starts[s], starts[s + 1]
        o1, l1 = attention_paged(q[a:b], kp, vp, table[s:s + 1], cl[s:s + 1], cu_of([b - a]), return_lse=True)
        assert torch.equal(o[a:b], o1) and torch.equal(lse[:, a:b], l1), f"sequence {s}"
    check_sequences(o, lse, q, k_seqs, v_seqs, q_lens, causal=True, scale=128 ** -0.5, against_attention=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 17, 64, 256])  # per key (1, 17), one entry a block (64, 256)
def test_append_gpu(page):
    test_append_then_attend("flash", page)


@pytest.mark.parametrize("page", [16, 5])
def test_warmup_ragged_runs_every_kernel_it_names(page):
    """kernels.warmup_ragged (what a worker runs at start-up for session steps): append, paged and
    varlen attention on one (Hkv, D) x dtype; under TRITON_INTERPRET=1 the flash kernels themselves."""
    from kernels import warmup_ragged

    assert warmup_ragged([(2, 16), (2, 16)], (torch.float32,), page_tokens=page, device=DEV) >= 0.0


@pytest.mark.parametrize("kernel", ["flash", "reference"])
def test_on_the_cpu_host_index_cannot_hide_a_bad_table(kernel):
    """With q on the CPU the tensors are on the host too: a host_index that disagrees with a table
    naming no page (9 of 6) is refused (flash read past the pool, reference raised IndexError)."""
    g = torch.Generator().manual_seed(0)
    kp, vp, q = torch.randn(6, 4, 1, 8, generator=g), torch.randn(6, 4, 1, 8, generator=g), torch.randn(2, 1, 8)

    def ints(*x):
        return torch.tensor(x, dtype=torch.int32)

    host = (ints(0, 2), ints(8), ints([0, 1]))  # the caller's copy, disagreeing
    with pytest.raises(BlockTableError, match="host_index's block_table does not hold the values"):
        attention_paged(q, kp, vp, ints([0, 9]), ints(8), ints(0, 2), kernel=kernel, host_index=host)
