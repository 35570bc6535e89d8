"""Score modifiers (window_size, softcap, alibi_slopes; kernels/masks.py) through every entry point.

Each answer is checked against ``tests.helpers.masked64``, the modifiers written out in float64 from
flash-attn's definitions (not kernels.masks), with STYLE item 11's budget: at most 2x the error of
the same formula in the inputs' dtype, plus one output rounding. On the CPU the "flash" kernels
run under TRITON_INTERPRET=1 (conftest sets it) at small sizes; the ``gpu`` tests add bfloat16,
the Gluon prefill's windows and softcap, and the other Hopper kernels' refusals.
"""

from __future__ import annotations

import pytest
import torch
from ragged_cases import cu_of, four, packed, paginate, split_rows

import kernels
from kernels import (
    DeviceMismatchError,
    DTypeError,
    KernelUnavailableError,
    MaskError,
    attention,
    attention_paged,
    attention_varlen,
    dispatch,
)
from kernels.spec import AttnSpec
from tests.helpers import assert_close_to_masked, masked64

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
HAS_CUDA = torch.cuda.is_available()


def check(o, lse, q, k, v, **opts):
    """o and lse against masked64 in float64 (the budget above); lse -inf exactly where a row sees no key."""
    _, ref_lse = assert_close_to_masked(o, q, k, v, **opts)
    dead = torch.isneginf(ref_lse)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert torch.equal(torch.isneginf(lse), dead), "lse is -inf exactly where a row sees no key"
    assert (o[dead] == 0).all(), "a row that sees no key gives o = 0"
    if (~dead).any():
        torch.testing.assert_close(lse.double()[~dead], ref_lse[~dead], atol=1e-4, rtol=1e-4)


def slopes_for(kind, b, hq, device="cpu"):
    """ALiBi slopes as in the ALiBi paper (2^(-8h/Hq)), shared ("h": (Hq,)) or per batch element ("bh")."""
    if not kind:
        return None
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float32)
    if kind == "h":
        return base.to(device)
    return (base[None, :] * torch.linspace(0.5, 2.0, b)[:, None]).contiguous().to(device)


def qkv(shape, dtype, seed=0, device="cpu"):
    b, hq, hkv, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(device=device, dtype=dtype)
                 for s in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))


# name: ((B, Hq, Hkv, Nq, Nk, D), causal, window, softcap, alibi) — a reason for each odd value
CASES = {
    "window_both_sides_gqa": ((2, 4, 2, 17, 97, 40), False, (8, 3), 0.0, None),     # Nq < Nk: rows sit at 80..96
    "window_0_causal": ((1, 2, 1, 97, 97, 16), True, (0, -1), 0.0, None),           # each row sees its own key only
    "window_0_0_nq_gt_nk": ((1, 2, 2, 33, 17, 40), False, (0, 0), 0.0, None),       # rows 0..15 see no key: 0, -inf
    "window_left_causal_nq_gt_nk": ((1, 2, 1, 97, 17, 64), True, (4, -1), 0.0, None),  # dead rows, then a band
    "window_right_only": ((1, 2, 2, 40, 40, 32), False, (-1, 5), 0.0, None),        # one-sided: the future bounded
    "window_wider_than_n": ((1, 2, 1, 17, 17, 40), False, (1000, 1000), 0.0, None),  # bounds nothing: plain path
    "window_straddles_blocks": ((1, 2, 1, 70, 130, 59), False, (40, 20), 0.0, None),  # unmasked middle blocks; D odd
    "softcap": ((2, 4, 4, 33, 70, 64), False, (-1, -1), 1.0, None),                 # cap 1: tanh far from linear
    "alibi_heads": ((1, 4, 2, 17, 97, 40), False, (-1, -1), 0.0, "h"),              # one slope set for every element
    "alibi_batch_causal": ((2, 4, 1, 33, 33, 40), True, (-1, -1), 0.0, "bh"),       # slopes per element, MQA
    "all_three_causal": ((2, 4, 2, 97, 129, 72), True, (20, -1), 2.0, "bh"),        # combined, Nq != Nk
    "decode_split": ((1, 4, 1, 1, 1025, 40), False, (100, -1), 1.0, "h"),           # split-KV: most splits empty
    "decode_causal_gqa": ((2, 8, 2, 3, 600, 64), True, (64, -1), 0.0, "bh"),        # GQA rows packed, keys split
}
FP16 = ["window_both_sides_gqa", "all_three_causal", "decode_split"]


def run_dense(name, dtype, kernel):
    shape, causal, window, cap, alibi = CASES[name]
    q, k, v = qkv(shape, dtype)
    slopes = slopes_for(alibi, shape[0], shape[1])
    o, lse = attention(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes,
                       return_lse=True, kernel=kernel)
    check(o, lse, q, k, v, causal=causal, window=window, softcap=cap, alibi=slopes)


@pytest.fixture
def cpu_path(monkeypatch):
    """kernel="auto" on the CPU without the interpreter: kernels.reference.cpu_attention."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kernel", ["reference", "flash"])
def test_dense_fp32(name, kernel):
    run_dense(name, torch.float32, kernel)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_cpu_path_fp32(name, cpu_path):
    assert dispatch.choose(spec("cpu")).name == "cpu"
    run_dense(name, torch.float32, "auto")


@pytest.mark.parametrize("name", FP16)
@pytest.mark.parametrize("kernel", ["flash", "auto"])
def test_dense_fp16(name, kernel, monkeypatch):
    if kernel == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    run_dense(name, torch.float16, kernel)


@pytest.mark.parametrize("kernel", ["flash", "auto"])
@pytest.mark.parametrize("name", ["all_three_causal", "decode_split"])
def test_batched_is_each_alone_bit_for_bit(name, kernel, monkeypatch):
    """Element b of a batch, with its own slopes row, equals the call on it alone, bit for bit."""
    if kernel == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    (_, hq, hkv, nq, nk, d), causal, window, cap, _ = CASES[name]
    b = 3
    q, k, v = qkv((b, hq, hkv, nq, nk, d), torch.float32, seed=5)
    slopes = slopes_for("bh", b, hq)
    opts = dict(causal=causal, window_size=window, softcap=cap, return_lse=True, kernel=kernel)
    o, lse = attention(q, k, v, alibi_slopes=slopes, **opts)
    for i in range(b):
        sl = slice(i, i + 1)
        o1, lse1 = attention(q[sl].clone(), k[sl].clone(), v[sl].clone(), alibi_slopes=slopes[sl].clone(), **opts)
        assert torch.equal(o[sl], o1) and torch.equal(lse[sl], lse1), f"element {i} differs from itself alone"


# ---- ragged: (q_lens, k_lens, Hq, Hkv, D, causal, window, softcap, alibi) ----
RAGGED = {
    "mixed_window": ([0, 1, 17, 40], [0, 700, 97, 40], 4, 2, 40, True, (30, -1), 0.0, "bh"),  # empty, split decode
    "cap_alibi_nq_gt_nk": ([33, 3], [17, 3], 2, 1, 64, False, (2, 1), 1.0, "h"),   # dead rows in sequence 0
}


def check_ragged(o, lse, q, k_seqs, v_seqs, q_lens, slopes, *, causal, window, cap):
    at = 0
    for s, n_q in enumerate(q_lens):
        q_s, o_s, lse_s = q[at:at + n_q], o[at:at + n_q], lse[:, at:at + n_q]
        at += n_q
        if n_q == 0:
            continue
        al = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[s])
        if k_seqs[s].shape[0] == 0:
            assert (o_s == 0).all() and torch.isneginf(lse_s).all()
            continue
        check(four(o_s), lse_s[None], four(q_s), four(k_seqs[s]), four(v_seqs[s]), causal=causal, window=window,
              softcap=cap, alibi=al)


@pytest.mark.parametrize("kernel", ["flash", "reference"])
@pytest.mark.parametrize("name", sorted(RAGGED))
def test_varlen(name, kernel):
    q_lens, k_lens, hq, hkv, d, causal, window, cap, alibi = RAGGED[name]
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, torch.float32, seed=1, device="cpu")
    slopes = slopes_for(alibi, len(q_lens), hq)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=cap,
                              alibi_slopes=slopes, return_lse=True, kernel=kernel)
    check_ragged(o, lse, q, split_rows(k, k_lens), split_rows(v, k_lens), q_lens, slopes, causal=causal,
                 window=window, cap=cap)


@pytest.mark.parametrize("page", [16, 5])   # one table entry a key block / a lookup per key
def test_paged(page):
    q_lens, k_lens, hq, hkv, d, causal, window, cap, alibi = RAGGED["mixed_window"]
    q, k, v, cu_q, _ = packed(q_lens, k_lens, hq, hkv, d, torch.float32, seed=2, device="cpu")
    k_seqs, v_seqs = split_rows(k, k_lens), split_rows(v, k_lens)
    k_pages, v_pages, table = paginate(k_seqs, v_seqs, page)
    slopes = slopes_for(alibi, len(q_lens), hq)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    o, lse = attention_paged(q, k_pages, v_pages, table, lens, cu_q, causal=causal, window_size=window,
                             softcap=cap, alibi_slopes=slopes, return_lse=True, kernel="flash")
    check_ragged(o, lse, q, k_seqs, v_seqs, q_lens, slopes, causal=causal, window=window, cap=cap)


def test_varlen_fp16_and_batch_invariance():
    """fp16 within budget; each sequence bit for bit itself alone (with its own slopes row)."""
    q_lens, k_lens, hq, hkv, d, causal, window, cap, alibi = RAGGED["mixed_window"]
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, torch.float16, seed=3, device="cpu")
    slopes = slopes_for(alibi, len(q_lens), hq)
    opts = dict(causal=causal, window_size=window, softcap=cap, return_lse=True, kernel="flash")
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes, **opts)
    qs, ks, vs = split_rows(q, q_lens), split_rows(k, k_lens), split_rows(v, k_lens)
    check_ragged(o, lse, q, ks, vs, q_lens, slopes, causal=causal, window=window, cap=cap)
    at = 0
    for s, n_q in enumerate(q_lens):
        o1, lse1 = attention_varlen(qs[s], ks[s], vs[s], cu_of([n_q], "cpu"), cu_of([k_lens[s]], "cpu"),
                                    alibi_slopes=slopes[s:s + 1].clone(), **opts)
        assert torch.equal(o[at:at + n_q], o1) and torch.equal(lse[:, at:at + n_q], lse1), f"sequence {s}"
        at += n_q


# ---- validation ----

@pytest.mark.parametrize(("opts", "error", "match"), [
    (dict(window_size=(-2, 0)), MaskError, ">= -1"),
    (dict(window_size=(1, 2, 3)), MaskError, "pair"),
    (dict(window_size=(1.0, 2)), MaskError, "pair of ints"),
    (dict(window_size=8), MaskError, "pair"),
    (dict(softcap=-1.0), MaskError, "softcap"),
    (dict(softcap=float("inf")), MaskError, "finite"),
    (dict(softcap=float("nan")), MaskError, "finite"),
    (dict(softcap=True), MaskError, "softcap"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), DTypeError, "float32"),
    (dict(alibi_slopes=torch.ones(5)), MaskError, r"\[4\] \(Hq\) or \[2, 4\]"),
    (dict(alibi_slopes=torch.ones(3, 4)), MaskError, "shape"),
    (dict(alibi_slopes=[0.5] * 4), MaskError, "tensor"),
    (dict(alibi_slopes=torch.tensor([1.0, float("nan"), 1.0, 1.0])), MaskError, "finite"),
    # finite, but inf in the kernels' log2 units (inf · 0 on the diagonal was NaN in the Triton kernels)
    (dict(alibi_slopes=torch.tensor([1.0, 3e38, 1.0, 1.0])), MaskError, r"\|slope\| <= 2.3e38"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), DeviceMismatchError, "alibi_slopes"),
])
def test_invalid_options_are_refused_with_a_clear_message(opts, error, match):
    q, k, v = qkv((2, 4, 2, 8, 8, 16), torch.float32)
    with pytest.raises(error, match=match):
        attention(q, k, v, **opts)
    with pytest.raises(error, match=match.replace("2, 4", "1, 4")):
        attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_of([8], "cpu"),
                         cu_of([8], "cpu"), **opts)


# ---- which kernel runs (STYLE item 14: apart from numerics) ----

def spec(device="cpu", masks=None):
    masks = kernels.masks.Masks(left=4) if masks is None else masks
    return AttnSpec(1, 4, 2, 16, 16, 64, torch.float16, torch.device(device), False, 0.125, False, masks)


def test_dispatch_with_masks_says_why(cpu_path):
    cuda = dispatch.choose(spec("cuda"))
    assert cuda.name == "flash" and "window_size" in cuda.refused["flash_v1"]
    cpu = dispatch.choose(spec("cpu"))
    assert cpu.name == "cpu" and "blockwise" in cpu.refused["cpu:sdpa"]
    with pytest.raises(KernelUnavailableError, match="flash_v1.*window_size"):
        dispatch.choose(spec("cuda"), "flash_v1")
    q, k, v = qkv((1, 2, 2, 8, 8, 16), torch.float32)
    with pytest.raises(KernelUnavailableError, match="flash_v1"):
        attention(q, k, v, softcap=2.0, kernel="flash_v1")
    assert dispatch.choose(spec("cuda", kernels.masks.NO_MASKS)).refused["flash_v1"].startswith("flash is faster")


def test_flash_refuses_the_tma_kernel_for_masked_calls_and_says_why():
    from kernels import flash

    q, k, v = qkv((1, 2, 2, 64, 64, 64), torch.float16)
    masks = kernels.masks.Masks(softcap=5.0)
    with pytest.raises(ValueError, match="tma=True.*no window_size, softcap or alibi_slopes"):
        flash.flash_forward(q, k, v, causal=False, scale=0.125, tma=True, masks=masks)
    why = flash._why_not(q, k, v, False, 0.125, 1, 1, None, True, "attn_fwd", masks=masks)
    assert set(why) == {"attn_fwd_ws", "attn_fwd_tma"} and "alibi_slopes" in why["attn_fwd_tma"]
    assert "head_dim 64" in why["attn_fwd_ws"]  # the Gluon prefill takes softcap, not D 64
    alibi = kernels.masks.Masks(alibi=torch.ones(1, 2))
    why = flash._why_not(q, k, v, False, 0.125, 1, 1, None, True, "attn_fwd", masks=alibi)
    assert "alibi_slopes" in why["attn_fwd_tma"] and "head_dim 64" in why["attn_fwd_ws"]  # ALiBi: Gluon takes it
    why = flash._why_not(q, k, v, False, 0.125, 2, 4, None, True, "attn_fwd", masks=masks)
    assert set(why) == {"attn_decode"} and "softcap" in why["attn_decode"]


def test_wide_window_is_plain_attention():
    """A window no row's keys reach bounds nothing: the spec carries no modifier (plain paths, Hopper included)."""
    q, k, v = qkv((1, 2, 2, 17, 40, 16), torch.float32)
    s = kernels.check_inputs(q, k, v, window_size=(39, 16))
    assert not s.masks.active
    assert kernels.check_inputs(q, k, v, window_size=(38, -1)).masks.left == 38
    assert kernels.check_inputs(q, k, v, causal=True, window_size=(3, 7)).masks.right == -1  # causal bounds it


# ---- gradients ----

# name: ((B, Hq, Hkv, Nq, Nk, D), causal, window, softcap, alibi)
GRAD_CASES = {
    "window_both_sides": ((1, 2, 1, 17, 40, 16), False, (5, 3), 0.0, None),         # GQA 2, Nq < Nk
    "window_causal_nq_gt_nk": ((1, 2, 1, 40, 17, 16), True, (4, -1), 0.0, None),    # rows with no key: zero grads
    "cap_alibi_batch": ((2, 4, 2, 33, 70, 40), False, (-1, -1), 1.0, "bh"),         # the cap's derivative
    "all_three_causal": ((1, 2, 2, 70, 97, 16), True, (20, -1), 2.0, "h"),          # band across key blocks
    "window_0_0": ((1, 2, 1, 70, 70, 16), False, (0, 0), 0.0, "h"),                 # one key a row: dq = dk = 0
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
@pytest.mark.parametrize("kernel", ["flash", "auto", "reference"])
def test_gradients_against_float64_autograd(name, kernel, monkeypatch):
    """The Triton backward ("flash"), PyTorch autograd through the CPU path ("auto" without the
    interpreter) and through the reference, against float64 autograd of masked64."""
    if kernel == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    shape, causal, window, cap, alibi = GRAD_CASES[name]
    q, k, v = qkv(shape, torch.float32, seed=7)
    slopes = slopes_for(alibi, shape[0], shape[1])
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, _ = masked64(q64, k64, v64, causal=causal, window=window, softcap=cap, alibi=slopes)
    want = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = attention(qg, kg, vg, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes, kernel=kernel)
    got = torch.autograd.grad(o, (qg, kg, vg), do)
    for name_, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-4, msg=lambda m, n=name_: f"d{n}: {m}")


# a cap of 2.3e38 stays on; past FLT_MAX / log2(e) (~2.36e38, inf in the kernels' log2 units) and past
# FLT_MAX (docs/api.md: "bounds nothing: off") it is off
@pytest.mark.parametrize("cap,on", [(2.3e38, True), (2.4e38, False), (3e38, False), (1e39, False)])
@pytest.mark.parametrize("kernel", ["flash", "auto", "reference"])
def test_softcap_past_float32_is_off(cap, on, kernel, monkeypatch):
    """A cap past float32's range, counted in the kernels' units (softcap · log2 e), is off on every
    kernel and entry point: the plain answer, never NaN."""
    if kernel == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = qkv((1, 2, 1, 5, 9, 16), torch.float32)
    assert kernels.check_inputs(q, k, v, softcap=cap).masks.active == on
    o, lse = attention(q, k, v, softcap=cap, return_lse=True, kernel=kernel)
    check(o, lse, q, k, v, softcap=cap if on else 0.0)
    qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))
    o, lse = attention_varlen(qt, kt, vt, cu_of([5], "cpu"), cu_of([9], "cpu"), softcap=cap, return_lse=True,
                              kernel=kernel)
    check(four(o), lse[None], q, k, v, softcap=cap if on else 0.0)


@pytest.mark.parametrize("kernel", ["flash", "auto", "reference"])
def test_lse_and_alibi_slopes_carry_no_gradient(kernel, monkeypatch):
    """docs/api.md: lse carries no gradient; the slopes get none either, on every kernel and whichever
    path the CPU takes (causal Nq != Nk under autograd, and any modifier, run its blockwise loop)."""
    if kernel == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.requires_grad_() for t in qkv((1, 2, 2, 4, 9, 16), torch.float32))
    o, lse = attention(q, k, v, causal=True, return_lse=True, kernel=kernel)
    assert o.requires_grad and not lse.requires_grad
    slopes = torch.tensor([0.1, 0.2], requires_grad=True)
    o, lse = attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True, kernel=kernel)
    assert o.requires_grad and not lse.requires_grad
    o.sum().backward()
    assert slopes.grad is None and q.grad is not None


# ---- on a GPU ----

# (shape, causal, window, softcap, ALiBi slopes, the kernel that serves it): the Gluon prefill takes
# windows, softcap and ALiBi; the TMA kernel's shapes (D 64) and the decode plans run attn_fwd
GPU_CASES = {
    "prefill_d128_window": ((2, 8, 2, 1025, 4097, 128), True, (256, -1), 0.0, None, "gluon"),
    "prefill_d128_window_cap": ((2, 4, 2, 2000, 2100, 128), False, (300, 100), 30.0, None, "gluon"),
    "prefill_d96_cap_causal": ((1, 4, 4, 2048, 2048, 96), True, (-1, -1), 20.0, None, "gluon"),
    # each row sees its own key only: a warpgroup's first block holds none of its rows' keys
    "prefill_d256_diagonal_window": ((1, 2, 2, 1000, 1000, 256), False, (0, 0), 0.0, None, "gluon"),
    "prefill_chunk_window": ((1, 4, 2, 300, 3000, 128), True, (500, -1), 0.0, None, "gluon"),
    "prefill_d128_alibi": ((1, 4, 4, 2048, 2048, 128), True, (-1, -1), 0.0, "h", "gluon"),
    # slopes per batch element with every other modifier, Nq != Nk (the bias's aligned positions)
    "prefill_d256_alibi_all": ((2, 4, 2, 1500, 2100, 256), True, (700, 50), 30.0, "bh", "gluon"),
    "prefill_d64_all": ((1, 8, 8, 2048, 2048, 64), False, (300, 100), 30.0, "bh", "attn_fwd"),   # TMA's shape
    "decode_split_gqa": ((4, 32, 8, 1, 8191, 128), True, (1024, -1), 50.0, "h", "attn_fwd"),    # Gluon decode's
}


def alone_slopes(slopes):
    """The last batch element's slopes: per-head ones ([Hq]) as they are, per-row ones ([B, Hq]) its row."""
    return None if slopes is None else slopes if slopes.dim() == 1 else slopes[-1:].clone()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_masked_calls_run_the_kernel_that_serves_them(name, dtype, monkeypatch):
    """Windows, softcap and ALiBi run the Gluon prefill (the size threshold lifted: tma=True in
    flash_forward is not reachable from attention, so the shapes are above it); the TMA kernel's
    shapes and decode plans run attn_fwd (the other Hopper kernels fail if called). Within budget of float64;
    batched equals each element alone, bit for bit."""
    from kernels import flash, hopper

    monkeypatch.setenv("ATTNSERVE_AUTOTUNE", "0")

    def refuse(*args, **kwargs):
        raise AssertionError("a Hopper kernel ran a call it does not serve")

    shape, causal, window, cap, alibi, kernel = GPU_CASES[name]
    ran = []
    if kernel == "gluon":
        real = hopper._forward_gluon
        monkeypatch.setattr(hopper, "_forward_gluon", lambda *a: ran.append(1) or real(*a))
    else:
        monkeypatch.setattr(flash, "_recipe", refuse)
    monkeypatch.setattr(flash, "_forward_tma", refuse)
    q, k, v = qkv(shape, dtype, device="cuda")
    slopes = slopes_for(alibi, shape[0], shape[1], "cuda")
    opts = dict(causal=causal, window_size=window, softcap=cap, return_lse=True)
    o, lse = attention(q, k, v, alibi_slopes=slopes, **opts)
    assert bool(ran) == (kernel == "gluon")
    al = None if slopes is None else slopes.cpu()
    check(o.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal=causal, window=window, softcap=cap, alibi=al)
    o1, lse1 = attention(q[-1:].clone(), k[-1:].clone(), v[-1:].clone(),
                         alibi_slopes=alone_slopes(slopes), **opts)
    assert torch.equal(o[-1:], o1) and torch.equal(lse[-1:], lse1)


@pytest.mark.gpu
def test_gpu_varlen_bf16():
    q_lens, k_lens, hq, hkv, d = [1, 17, 1025], [4097, 97, 1025], 8, 2, 128
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, torch.bfloat16, device="cuda")
    slopes = slopes_for("bh", 3, hq, "cuda")
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(200, -1), softcap=20.0,
                              alibi_slopes=slopes, return_lse=True)
    check_ragged(o.cpu(), lse.cpu(), q.cpu(), split_rows(k.cpu(), k_lens), split_rows(v.cpu(), k_lens), q_lens,
                 slopes.cpu(), causal=True, window=(200, -1), cap=20.0)


@pytest.mark.gpu
@pytest.mark.parametrize("page,alibi", [(0, None), (64, None), (0, "bh"), (64, "h")])  # varlen keys; pages of 64
def test_gpu_ragged_prefill_window_softcap(page, alibi, monkeypatch):
    """A window and softcap (and ALiBi slopes, per sequence or shared) in ragged_prefill (Gluon):
    prefill and chunk tiles whose first and last blocks cross the window's edges, beside a decode,
    within the budget of float64."""
    from kernels import ragged

    q_lens, k_lens, hq, hkv, d = [1, 300, 200], [4097, 300, 2500], 8, 2, 128
    q, k, v, cu_q, cu_k = packed(q_lens, k_lens, hq, hkv, d, torch.bfloat16, device="cuda")
    k_seqs, v_seqs = split_rows(k, k_lens), split_rows(v, k_lens)
    slopes = slopes_for(alibi, len(q_lens), hq, "cuda")
    opts = dict(causal=True, window_size=(200, -1), softcap=20.0, alibi_slopes=slopes, return_lse=True)
    cfg = ragged.kernel_config("chunk", d, q.dtype, False, True)
    if page:
        k_pages, v_pages, table = paginate(k_seqs, v_seqs, page)
        lens = torch.tensor(k_lens, dtype=torch.int32, device="cuda")
        assert ragged.gluon_prefill_refusal(q, k_pages, v_pages, True, cfg) is None
        o, lse = attention_paged(q, k_pages, v_pages, table, lens, cu_q, **opts)
    else:
        assert ragged.gluon_prefill_refusal(q, k, v, False, cfg) is None
        o, lse = attention_varlen(q, k, v, cu_q, cu_k, **opts)
    check_ragged(o.cpu(), lse.cpu(), q.cpu(), [t.cpu() for t in k_seqs], [t.cpu() for t in v_seqs], q_lens,
                 None if slopes is None else slopes.cpu(), causal=True, window=(200, -1), cap=20.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_backward_16bit(dtype, monkeypatch):
    """The Triton backward with every modifier: error at most 2x that of float32 autograd of
    masked64 on the same 16-bit inputs, plus slack."""
    monkeypatch.setenv("ATTNSERVE_AUTOTUNE", "0")
    shape, causal, window, cap, opts = (2, 8, 2, 257, 1025, 128), True, (128, -1), 20.0, {}
    q, k, v = qkv(shape, dtype, device="cuda")
    slopes = slopes_for("bh", shape[0], shape[1], "cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    opts = dict(causal=causal, window=window, softcap=cap, alibi=slopes.cpu())
    q64, k64, v64 = (t.cpu().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(masked64(q64, k64, v64, **opts)[0], (q64, k64, v64), do.cpu().double())
    q32, k32, v32 = (t.cpu().float().requires_grad_() for t in (q, k, v))
    plain = torch.autograd.grad(masked64(q32, k32, v32, dtype=torch.float32, **opts)[0], (q32, k32, v32),
                                do.cpu().float())
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = attention(qg, kg, vg, causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
    got = torch.autograd.grad(o, (qg, kg, vg), do)
    for g, p, w in zip(got, plain, want, strict=True):
        err = (g.cpu().double() - w).abs().max().item()
        budget = 2 * (p.double() - w).abs().max().item() + 4 * torch.finfo(dtype).eps * w.abs().max().item()
        assert err <= budget, f"gradient error {err:.3g} over budget {budget:.3g}"


@pytest.mark.parametrize("kernel", ["flash", "reference"])
def test_window_sides_past_2_30_are_unbounded_on_the_ragged_entry_points(kernel):
    """A side of 2**30 or more is unbounded (docs/api.md) in attention_varlen and attention_paged
    too: bit for bit the -1 call (2**63 - 1 once reached their integer arithmetic and left every row
    with no key; 2**64 raised OverflowError). numpy integers are sides too."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g)
    cq, ck = cu_of([4], "cpu"), cu_of([6], "cpu")
    kp, vp = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    kp.view(-1, 1, 8)[:6], vp.view(-1, 1, 8)[:6] = k, v
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    for window, same in [((2**63 - 1, 2**63 - 1), (-1, -1)), ((0, 2**63 - 1), (0, -1)), ((2**64, 0), (-1, 0)),
                         ((np.int64(2), np.int64(1)), (2, 1))]:
        want = attention_varlen(q, k, v, cq, ck, window_size=same, kernel=kernel, return_lse=True)
        got = attention_varlen(q, k, v, cq, ck, window_size=window, kernel=kernel, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), window
        want = attention_paged(q, kp, vp, table, lens, cq, causal=False, window_size=same, kernel=kernel)
        got = attention_paged(q, kp, vp, table, lens, cq, causal=False, window_size=window, kernel=kernel)
        assert torch.equal(got, want), window
