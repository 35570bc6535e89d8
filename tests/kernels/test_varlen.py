"""attention_varlen (docs/api.md#ragged-and-paged-batches): packed sequences, each attended alone, in one launch.

On the CPU the "flash" kernels run under TRITON_INTERPRET=1 (conftest sets it) at tiny sizes;
the ``gpu`` tests repeat the tables on CUDA with bfloat16, long and many sequences. Error budget
as tests/kernels/test_triton_forward.py's: at most 2x plain PyTorch's error in the same dtype, plus a
small absolute slack; and each sequence agrees with kernels.attention run on it alone.
"""

from __future__ import annotations

import pytest
import torch
from ragged_cases import DEV, check_sequences, cu_of, nan_empty, packed, split_rows

from kernels import (
    DTypeError,
    HeadDimError,
    KernelUnavailableError,
    OptionError,
    SeqLensError,
    ShapeError,
    attention_varlen,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
KERNELS = ["flash", "reference"]

# name: (q_lens, k_lens, Hq, Hkv, D, causal) — a reason for each odd value
CASES = {
    "empty_and_keyless": ([0, 1, 3], [0, 1, 0], 4, 4, 40, False),   # an empty sequence; one with queries but no key
    "gqa_prime_causal": ([17, 97], [17, 97], 8, 2, 72, True),       # GQA 4, prime lengths, causal tiles and blocks
    "mqa_decode_split": ([1, 2], [600, 1025], 5, 1, 40, True),      # decode rows packed, keys split and merged
    "causal_nq_gt_nk": ([97, 3], [17, 0], 2, 1, 64, True),          # rows 0..79 see no key: o = 0, lse = -inf
    "d256": ([17, 5], [33, 65], 2, 2, 256, False),                  # the largest head dim
    "chunk_vs_long_cache": ([65, 1], [300, 1], 4, 4, 128, True),    # a prefill chunk (3 row tiles) after 235 keys
    "d_odd": ([3, 17], [40, 17], 4, 2, 59, False),                  # D = 59: not a power of two, odd
}
FP16 = ["gqa_prime_causal", "mqa_decode_split", "d256"]
GPU_ONLY = {
    "long_q_1025": ([1025, 1], [1025, 4097], 8, 2, 128, True),      # 1025: one past a block boundary
    "many_lengths": ([1, 17, 97, 1025, 0, 64, 65], [1, 17, 97, 1025, 5, 4096, 65], 32, 8, 128, True),
    # ragged_prefill (Gluon): a 40-row chunk split along its keys, D 96 padded to 128; D 192 (a box
    # of 256, 64-key blocks) non-causal, two row tiles against 5000 keys beside a decode
    "gluon_split_d96": ([40, 300, 2], [6000, 300, 2000], 16, 4, 96, True),
    "gluon_d192_full": ([130, 1], [5000, 700], 8, 8, 192, False),
}


def run_case(case, dtype, kernel, seed=0, against_attention=True):
    q_lens, k_lens, hq, hkv, d, causal = case
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, dtype, seed)
    scale = d ** -0.5
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, return_lse=True, kernel=kernel)
    check_sequences(o, lse, q, split_rows(k, k_lens), split_rows(v, k_lens), q_lens, causal=causal, scale=scale,
                    against_attention=against_attention)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_varlen_fp32(name, kernel, monkeypatch):
    nan_empty(monkeypatch)
    run_case(CASES[name], torch.float32, kernel)


@pytest.mark.parametrize("name", FP16)
def test_varlen_fp16(name, monkeypatch):
    nan_empty(monkeypatch)
    run_case(CASES[name], torch.float16, "flash")


def test_varlen_reference_long():
    """1025 on the CPU path (the interpreter is too slow for it in prefill), against float64 only."""
    run_case(GPU_ONLY["long_q_1025"][:2] + (4, 2, 40, True), torch.float32, "reference", against_attention=False)


@pytest.mark.parametrize("kernel", KERNELS)
def test_varlen_batch_invariance(kernel):
    """A sequence's o and lse in a batch are bit for bit those of the sequence alone, whatever its
    neighbours (a split decode, a packed decode, prefill tiles, an empty sequence)."""
    q_lens, k_lens = [1, 0, 40, 2, 1], [700, 3, 50, 2, 9]
    hq, hkv, d = 4, 2, 40
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, torch.float32, seed=3)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, kernel=kernel)
    qs, ks, vs = split_rows(q, q_lens), split_rows(k, k_lens), split_rows(v, k_lens)
    at = 0
    for s, n in enumerate(q_lens):
        o1, l1 = attention_varlen(qs[s], ks[s], vs[s], cu_of([n]), cu_of([k_lens[s]]), causal=True,
                                  return_lse=True, kernel=kernel)
        assert torch.equal(o[at:at + n], o1) and torch.equal(lse[:, at:at + n], l1), f"sequence {s}"
        at += n
    # the same sequences in another order, with others around them: the same bits
    order = [4, 2, 0, 3]
    o2, l2 = attention_varlen(torch.cat([qs[s] for s in order]), torch.cat([ks[s] for s in order]),
                              torch.cat([vs[s] for s in order]), cu_of([q_lens[s] for s in order]),
                              cu_of([k_lens[s] for s in order]), causal=True, return_lse=True, kernel=kernel)
    starts = cu_of(q_lens).tolist()
    at = 0
    for s in order:
        n = q_lens[s]
        assert torch.equal(o2[at:at + n], o[starts[s]:starts[s] + n])
        assert torch.equal(l2[:, at:at + n], lse[:, starts[s]:starts[s] + n])
        at += n


def test_varlen_no_sequences():
    q, k, v, cu_q, cu_k = packed([], [], 2, 2, 16, torch.float32)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)


def _bad(**change):
    q, k, v, cu_q, cu_k = packed([2, 3], [4, 5], 4, 2, 16, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update({name: fn(args) for name, fn in change.items()})
    return args


def idx(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


BAD = {  # name: (change, error, message fragment)
    "q_4d": (dict(q=lambda a: a["q"][None]), ShapeError, "3 dims"),
    "dtype_mix": (dict(k=lambda a: a["k"].half()), DTypeError, "one dtype"),
    "heads": (dict(k=lambda a: a["k"].repeat(1, 2, 1)[:, :3], v=lambda a: a["v"].repeat(1, 2, 1)[:, :3]),
              ShapeError, "multiple"),
    "head_dim": (dict(q=lambda a: torch.zeros(5, 4, 300, device=DEV), k=lambda a: torch.zeros(9, 2, 300, device=DEV),
                      v=lambda a: torch.zeros(9, 2, 300, device=DEV)), HeadDimError, "head dim"),
    "cu_int64": (dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()), SeqLensError, "int32"),
    "cu_2d": (dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"][None]), SeqLensError, "shape"),
    "cu_not_zero": (dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"] + 1), SeqLensError, "start at 0"),
    "cu_decreasing": (dict(cu_seqlens_k=lambda a: idx([0, 10, 9])), SeqLensError,
                      "non-decreasing"),
    "cu_short_end": (dict(cu_seqlens_q=lambda a: idx([0, 2, 4])), SeqLensError,
                     "end at"),
    "cu_counts": (dict(cu_seqlens_k=lambda a: idx([0, 9])), SeqLensError, r"S \+ 1"),
    "scale_nan": (dict(), OptionError, "finite"),
    "max_seqlen_q_short": (dict(max_seqlen_q=lambda a: 2), SeqLensError, "max_seqlen_q is 2, but a sequence has 3"),
    "max_seqlen_k_float": (dict(max_seqlen_k=lambda a: 5.0), SeqLensError, "must be an int"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_varlen_bad_inputs(name):
    change, error, fragment = BAD[name]
    args = _bad(**change)
    extra = dict(scale=float("nan")) if name == "scale_nan" else {}
    with pytest.raises(error, match=fragment):
        attention_varlen(**args, **extra)


def test_varlen_flash_attn_keywords():
    """Code written for flash_attn_varlen_func passes max_seqlen_q/k by keyword (ints or 0-d tensors):
    the same answer as without them."""
    q, k, v, cu_q, cu_k = packed([2, 3], [4, 5], 4, 2, 16, torch.float32)
    plain = attention_varlen(q, k, v, cu_q, cu_k, causal=True, kernel="reference")
    bounded = attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3,
                               max_seqlen_k=torch.tensor(7, dtype=torch.int32), causal=True, kernel="reference")
    assert torch.equal(plain, bounded)


def test_varlen_kernel_choice(monkeypatch):
    q, k, v, cu_q, cu_k = packed([2], [3], 2, 2, 16, torch.float32, device="cpu")
    with pytest.raises(KernelUnavailableError, match="flash_v1"):
        attention_varlen(q, k, v, cu_q, cu_k, kernel="flash_v1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="CUDA"):
        attention_varlen(q, k, v, cu_q, cu_k, kernel="flash")
    o = attention_varlen(q, k, v, cu_q, cu_k)  # auto: the CPU loop
    assert o.shape == q.shape


# ---- GPU ----

# Every case in bfloat16 (the serving dtype, checked against kernels.attention too); float16 and
# float32 (float32 has its own tiles) on cases that cover the decode and prefill classes and D 256:
# each distinct kernel config compiles once or twice, not once per case and dtype.
GPU_FP32 = ["chunk_vs_long_cache", "d256", "mqa_decode_split"]
GPU_RUNS = ([(name, torch.bfloat16) for name in sorted(CASES) + sorted(GPU_ONLY)]
            + [(name, torch.float16) for name in FP16] + [(name, torch.float32) for name in GPU_FP32])


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "dtype"), GPU_RUNS)
def test_varlen_gpu(name, dtype, monkeypatch):
    nan_empty(monkeypatch)
    case = {**CASES, **GPU_ONLY}[name]
    q_lens, k_lens, hq, hkv, d, causal = case
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, dtype)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, kernel="flash")
    check_sequences(o, lse, q, split_rows(k, k_lens), split_rows(v, k_lens), q_lens, causal=causal,
                    scale=d ** -0.5, against_attention=dtype == torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_gpu_many_sequences_batch_invariant(dtype):
    """256 sequences of mixed lengths in one launch; each bit-equal to itself alone, and the whole
    batch within the error budget of float64 (not kernels.attention per sequence: 256 shapes to
    compile and tune; test_varlen_gpu compares with it)."""
    g = torch.Generator().manual_seed(1)
    q_lens = torch.randint(0, 80, (256,), generator=g).tolist()
    k_lens = [n + int(x) for n, x in zip(q_lens, torch.randint(0, 3000, (256,), generator=g), strict=True)]
    q_lens[:8] = [1] * 8  # decodes among them
    hq, hkv, d = 32, 8, 128
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, dtype)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    qs, ks, vs = split_rows(q, q_lens), split_rows(k, k_lens), split_rows(v, k_lens)
    for s in range(0, 256, 7):
        n = q_lens[s]
        o1, l1 = attention_varlen(qs[s], ks[s], vs[s], cu_of([n]), cu_of([k_lens[s]]), causal=True,
                                  return_lse=True)
        start = sum(q_lens[:s])
        assert torch.equal(o[start:start + n], o1) and torch.equal(lse[:, start:start + n], l1), f"sequence {s}"
    check_sequences(o, lse, q, ks, vs, q_lens, causal=True, scale=d ** -0.5, against_attention=False)


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [True, False])  # ragged_prefill (Gluon), then ragged_fwd
def test_varlen_gpu_poisoned_neighbour(gluon, monkeypatch):
    """A sequence whose q, k and v are NaN and inf harms no other: its neighbours' last key blocks
    and row tiles reach into its rows, and their answers stay bit for bit their answers alone."""
    from kernels import ragged

    monkeypatch.setattr(ragged, "GLUON_PREFILL", gluon)
    q_lens, k_lens, hq, hkv, d = [300, 200, 150], [700, 333, 901], 16, 4, 128
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, torch.bfloat16)
    k[700:1033] = float("inf")
    v[700:1033] = float("nan")
    q[300:500] = float("nan")
    if gluon:
        cfg = ragged.kernel_config("prefill", d, q.dtype, False, True)
        assert ragged.gluon_prefill_refusal(q, k, v, False, cfg) is None
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    qs, ks, vs = split_rows(q, q_lens), split_rows(k, k_lens), split_rows(v, k_lens)
    for s, (a, b) in ((0, (0, 300)), (2, (500, 650))):
        o1, l1 = attention_varlen(qs[s].clone(), ks[s].clone(), vs[s].clone(), cu_of([q_lens[s]]),
                                  cu_of([k_lens[s]]), causal=True, return_lse=True)
        assert torch.isfinite(o1).all()
        assert torch.equal(o[a:b], o1) and torch.equal(lse[:, a:b], l1), f"sequence {s}"
