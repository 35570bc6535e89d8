"""Non-finite inputs (docs/api.md, "Inputs"): every kernel, dtype and entry point gives the IEEE
answer. A row whose scores meet a NaN or a +inf (from q or k) is NaN in every element of o and in
lse; every other row is the float64 answer, as if the bad element were not there. A -inf score is
a key the row does not see.

Kernels on the CPU: the reference, the blockwise loop, the CPU path, and the Triton kernels under
TRITON_INTERPRET=1 (fp32 and fp16); the ``gpu`` test repeats every kernel on CUDA in bf16 too.
"""

from __future__ import annotations

import math

import pytest
import torch
from ragged_cases import DEV, cu_of, paginate, randn

from kernels import attention, attention_paged, attention_varlen
from kernels.reference import blockwise_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton", "ignore::RuntimeWarning")
INF, NAN = float("inf"), float("nan")
HAS_CUDA = torch.cuda.is_available()


def expected(q, k, v, causal: bool, scale: float):
    """(bad rows (B, H, Nq) bool, o64, lse64) in float64: bad where a visible score is NaN or +inf."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    s = q64 @ k64.transpose(-1, -2) * scale
    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
    visible = visible.to(s.device)
    bad = ((s.isnan() | (s == INF)) & visible).any(-1)
    s = torch.where(visible & ~s.isnan(), s, -INF)
    s = torch.where(bad[..., None], torch.zeros_like(s), s)  # any value: those rows are checked as NaN
    keyless = (s == -INF).all(-1, keepdim=True)  # every score -inf: o = 0, lse = -inf (the contract)
    o64 = torch.where(keyless, 0.0, torch.softmax(torch.where(keyless, 0.0, s), -1) @ v64)
    return bad, o64, torch.logsumexp(s, -1)


def check(o, lse, q, k, v, causal, scale):
    bad, o64, lse64 = expected(q, k, v, causal, scale)
    assert bad.any() and not bad.all(), "the case must hold both kinds of row"
    assert o[bad].isnan().all() and lse[bad].isnan().all(), "a row that met NaN/+inf must be NaN"
    o, lse, o64, lse64 = o[~bad].double(), lse[~bad].double(), o64[~bad], lse64[~bad]
    assert torch.isfinite(o).all() and not lse.isnan().any()
    assert torch.equal(lse == -INF, lse64 == -INF)
    tol = 1e-4 if q.dtype == torch.float32 else 3e-2
    assert (o - o64).abs().max() <= tol
    finite = lse64 > -INF
    assert not finite.any() or (lse[finite] - lse64[finite]).abs().max() <= tol


def inputs(dtype, poison: str, n_q=5, n_k=37, d=24, device=DEV):
    """B 1, H 2 (q, k, v): one bad element placed as ``poison`` says."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (randn(g, 1, 2, n, d, dtype=dtype, device=device) for n in (n_q, n_k, n_k))
    if poison == "q_inf":
        q[0, 1, 2, 5] = INF            # row 2 of head 1: scores +-inf
    elif poison == "q_nan":
        q[0, 0, 0, 3] = NAN
    elif poison == "k_inf":
        k[0, 0, 9, 0] = INF            # rows of head 0 with q[..., 0] > 0 see +inf, the others -inf
        q[0, 0, :2, 0], q[0, 0, 2:, 0] = q[0, 0, :2, 0].abs(), -q[0, 0, 2:, 0].abs()
    return q, k, v


KERNELS = ["reference", "cpu", "flash", "flash_v1"]


@pytest.fixture
def kernel(request, monkeypatch):
    """The kernel a test names; "cpu" is the CPU server's "auto" (torch's CPU kernel), which this
    suite's TRITON_INTERPRET=1 would otherwise turn into the Triton kernels."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return "auto"
    return request.param
POISONS = ["q_inf", "q_nan", "k_inf"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_attention(kernel, dtype, poison, causal):
    q, k, v = inputs(dtype, poison)
    o, lse = attention(q, k, v, causal=causal, return_lse=True, kernel=kernel)
    check(o, lse, q, k, v, causal, q.shape[-1] ** -0.5)


def minus_inf_keys(dtype, first: int, n_q=5, n_k=200, d=24, device=DEV):
    """B 1, H 2: every row of head 0 scores -inf on keys 0..first-1 (a -inf element where its q is
    > 0), whole key blocks for every tile size when first >= 128; head 1's row 0 meets a NaN (the
    case's bad row)."""
    q, k, v = inputs(dtype, "none", n_q=n_q, n_k=n_k, d=d, device=device)
    q[0, 0, :, 0] = q[0, 0, :, 0].abs() + 0.1
    k[0, 0, :first, 0] = -INF
    q[0, 1, 0, 3] = NAN
    return q, k, v


@pytest.mark.parametrize("first", [128, 200], ids=["blocks", "every-key"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_keys_of_minus_inf_are_not_seen(kernel, dtype, causal, first):
    """Whole key blocks of -inf scores: the softmax over the other keys (the Triton kernels once
    subtracted -inf from -inf there when the block needed no mask: NaN); every key -inf: o = 0,
    lse = -inf."""
    q, k, v = minus_inf_keys(dtype, first)
    o, lse = attention(q, k, v, causal=causal, return_lse=True, kernel=kernel)
    check(o, lse, q, k, v, causal, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("first", [128, 200], ids=["blocks", "every-key"])
@pytest.mark.parametrize("kernel", ["flash", "reference"])
def test_keys_of_minus_inf_in_varlen_paged_and_split_decode(kernel, first):
    """The same through the ragged kernels (varlen, paged: session steps) and a split-KV decode."""
    q, k, v = minus_inf_keys(torch.float16, first)
    cu_q, cu_k = cu_of([5]), cu_of([200])
    sq, sk, sv = _as_sequences(q, k, v)
    o_v, lse_v = attention_varlen(sq, sk, sv, cu_q, cu_k, causal=True, return_lse=True, kernel=kernel)
    kp, vp, table = paginate([sk], [sv], page=16)
    lens = torch.tensor([200], dtype=torch.int32, device=DEV)
    o_p, lse_p = attention_paged(sq, kp, vp, table.to(DEV), lens, cu_q, causal=True, return_lse=True, kernel=kernel)
    for o, lse in ((o_v, lse_v), (o_p, lse_p)):
        check(o.transpose(0, 1)[None], lse[None], q, k, v, True, 24 ** -0.5)
    q, k, v = minus_inf_keys(torch.float16, 10 * first, n_q=1, n_k=2000)  # one row over 2,000 keys: splits
    o, lse = attention(q, k, v, return_lse=True, kernel=kernel)
    check(o, lse, q, k, v, False, 24 ** -0.5)


def one_row(q: float, keys: list[float], values: list[float], kernel: str, **options) -> tuple[float, float]:
    """(o, lse) of one query row of D 1 over keys whose scores are q · k (scale 1)."""
    k, v = (torch.tensor(x, device=DEV).reshape(1, 1, -1, 1) for x in (keys, values))
    o, lse = attention(torch.full((1, 1, 1, 1), q, device=DEV), k, v, scale=1.0, return_lse=True, kernel=kernel,
                       **options)
    return o.item(), lse.item()


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_a_score_that_overflows_to_minus_inf_is_a_key_not_seen(kernel):
    """Finite inputs whose product leaves float32 (1e20 · -1e20): that key is not seen. Alone it
    leaves the row keyless (o = 0, lse = -inf; the CPU path once answered lse = 0); beside a finite
    key, the row is that key's."""
    assert one_row(1e20, [-1e20], [5.0], kernel) == (0.0, -INF)
    o, lse = one_row(1e20, [-1e20, 1.0], [5.0, 7.0], kernel)
    assert o == 7.0 and lse == pytest.approx(1e20, rel=1e-6)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_a_score_past_the_kernels_log2_range_is_infinite(kernel):
    """A score finite in float32 but past FLT_MAX / log2(e) (~2.36e38) is ±inf in the kernels'
    log2 units, so on every kernel: +3e38 makes the row NaN, -3e38 is a key not seen (the
    reference once answered o = 1 and lse = 3e38 where the Triton kernels answered NaN)."""
    o, lse = one_row(1.0, [3e38, 0.0], [1.0, 2.0], kernel)
    assert math.isnan(o) and math.isnan(lse)
    assert one_row(1.0, [-3e38], [1.0], kernel) == (0.0, -INF)
    o, lse = one_row(1.0, [-3e38, 0.0], [1.0, 2.0], kernel)
    assert o == 2.0 and lse == pytest.approx(0.0, abs=1e-6)
    if kernel != "flash_v1":  # (it takes no score modifiers)
        # under a cap the overflowing score is the cap (tanh(inf) = 1): a key the row sees
        o, _ = one_row(1.0, [3e38, 0.0], [1.0, 2.0], kernel, softcap=2.0)
        w = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64), 0)
        assert o == pytest.approx(float(w[0] + 2 * w[1]), rel=1e-5)


@pytest.mark.parametrize("cap", [1e-300, 1e-40])
def test_a_cap_below_float32s_smallest_normal_is_refused(cap):
    """0 or subnormal in the kernels' float32, a cap made 0 / cap NaN (every row of a zero q)."""
    q, k, v = (torch.randn(1, 1, 3, 4, device=DEV) for _ in range(3))
    with pytest.raises(ValueError, match="smallest normal"):
        attention(q, k, v, softcap=cap)
    attention(q, k, v, softcap=1.2e-38)  # the smallest normal and up: taken


@pytest.mark.parametrize("n_k", [1, 4, 7])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_a_nan_over_few_keys_is_nan(kernel, n_k):
    """Fewer than 8 keys: torch's CPU kernel (auto) answers a row whose scores meet a NaN with
    o = 0, lse = 0, which looks valid; the contract's NaN must still come back. Also with a batch
    element beside it, which keeps its own bits."""
    q, k, v = inputs(torch.float32, "q_nan", n_q=5, n_k=n_k)
    o, lse = attention(q, k, v, return_lse=True, kernel=kernel)
    check(o, lse, q, k, v, False, q.shape[-1] ** -0.5)
    good = inputs(torch.float32, "none", n_q=5, n_k=n_k)
    both = [torch.cat([a, b]) for a, b in zip(good, (q, k, v), strict=True)]
    o2, lse2 = attention(*both, return_lse=True, kernel=kernel)
    alone = attention(*good, return_lse=True, kernel=kernel)
    assert torch.equal(o2[:1], alone[0]) and torch.equal(lse2[:1], alone[1])
    assert torch.equal(o2[1:].isnan(), o.isnan()) and torch.equal(lse2[1:].isnan(), lse.isnan())


MODIFIERS = {"none": {}, "softcap": {"softcap": 5.0}, "window": {"window_size": (3, 3)},
             "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25], device=DEV)}}


@pytest.mark.parametrize("modifier", list(MODIFIERS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kernel", ["reference", "cpu", "flash"], indirect=True)
def test_padding_may_hold_nan(kernel, causal, modifier):
    """Keys past kv_lengths are padding (``torch.empty`` may leave NaN there): the answer is the
    bits of the same call with finite padding, on every kernel and score modifier (those answers
    are checked against float64 in test_kernels_reference.py and test_masks.py)."""
    g = torch.Generator().manual_seed(3)
    q = randn(g, 2, 2, 6, 16, dtype=torch.float32)
    k, v = randn(g, 2, 2, 40, 16, dtype=torch.float32), randn(g, 2, 2, 40, 16, dtype=torch.float32)
    lengths = torch.tensor([23, 40], dtype=torch.int32, device=DEV)
    opts = MODIFIERS[modifier]
    clean = attention(q, k, v, causal=causal, kv_lengths=lengths, return_lse=True, kernel=kernel, **opts)
    k[0, :, 23:], v[0, :, 23:] = NAN, INF
    o, lse = attention(q, k, v, causal=causal, kv_lengths=lengths, return_lse=True, kernel=kernel, **opts)
    assert torch.isfinite(o).all(), "padding reached the answer"
    assert torch.equal(o, clean[0]) and torch.equal(lse, clean[1])


@pytest.mark.parametrize("poison", POISONS)
def test_decode_split_kv(poison):
    """One query row over 2,000 keys: the flash plan splits the keys and merges the splits' lse."""
    q, k, v = inputs(torch.float16, "none", n_q=1, n_k=2000, d=16)
    if poison == "q_inf":
        q[0, 1, 0, 5] = INF
    elif poison == "q_nan":
        q[0, 0, 0, 3] = NAN
    else:                               # head 0's row meets +inf; head 1's stays good
        q[0, 0, 0, 0] = q[0, 0, 0, 0].abs()
        k[0, 0, 1500, 0] = INF
    o, lse = attention(q, k, v, return_lse=True, kernel="flash")
    check(o, lse, q, k, v, False, 0.25)


@pytest.mark.parametrize("poison", POISONS)
def test_blockwise(poison):
    q, k, v = inputs(torch.float32, poison)
    o, lse = blockwise_attention(q, k, v, causal=False, scale=0.2, block_k=8)
    check(o, lse, q, k, v, False, 0.2)


def _as_sequences(q, k, v):
    """(1, H, N, D) -> (N, H, D): one sequence of the packed layout."""
    return q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()


@pytest.mark.parametrize("kernel", ["flash", "reference"])
@pytest.mark.parametrize("poison", POISONS)
def test_varlen_and_paged_keep_a_bad_sequence_to_itself(kernel, poison):
    """Sequence 0 holds the bad element; sequence 1, in the same launch, is untouched."""
    bad_q, bad_k, bad_v = inputs(torch.float16, poison)
    good_q, good_k, good_v = inputs(torch.float16, "none", n_q=3, n_k=20)
    seqs = [_as_sequences(bad_q, bad_k, bad_v), _as_sequences(good_q, good_k, good_v)]
    q = torch.cat([s[0] for s in seqs])
    k = torch.cat([s[1] for s in seqs])
    v = torch.cat([s[2] for s in seqs])
    cu_q, cu_k = cu_of([5, 3]), cu_of([37, 20])
    o_v, lse_v = attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, kernel=kernel)
    kp, vp, table = paginate([s[1] for s in seqs], [s[2] for s in seqs], page=16)
    lens = torch.tensor([37, 20], dtype=torch.int32, device=DEV)
    o_p, lse_p = attention_paged(q, kp, vp, table.to(DEV), lens, cu_q, causal=True, return_lse=True,
                                 kernel=kernel)
    for o, lse in ((o_v, lse_v), (o_p, lse_p)):
        # back to (1, H, N, D) per sequence
        o0, l0 = o[:5].transpose(0, 1)[None], lse[:, :5][None]  # lse is (Hq, Tq)
        o1, l1 = o[5:].transpose(0, 1)[None], lse[:, 5:][None]
        check(o0, l0, bad_q, bad_k, bad_v, True, 24 ** -0.5)
        want = attention(good_q, good_k, good_v, causal=True, return_lse=True, kernel=kernel)
        assert torch.isfinite(o1).all() and torch.isfinite(l1).all()
        assert (o1.double() - want[0].double()).abs().max() <= 3e-2


def poisoned_last_row(dtype, poison: str, n_q: int, n_k: int, d: int, device="cuda"):
    """(q, k, v) of B 1, H 2 with the bad element in the last query row, which sees every key with
    or without causal (a row that sees few keys may meet only -inf, and one row has no first)."""
    q, k, v = inputs(dtype, "none", n_q=n_q, n_k=n_k, d=d, device=device)
    if poison == "q_inf":
        q[0, 1, -1, 5] = INF
    elif poison == "q_nan":
        q[0, 0, -1, 3] = NAN
    else:                               # every row of head 0 that sees key 9 meets +inf
        k[0, 0, 9, 0] = INF
        q[0, 0, :, 0] = q[0, 0, :, 0].abs()
    return q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["auto", "flash", "flash_v1", "reference"])
def test_gpu_every_kernel(kernel, dtype):
    """On CUDA, every kernel (auto: the Hopper kernels on sm_90) in fp16 and bf16, prefill and decode."""
    for n_q, n_k, d in ((300, 300, 128), (1, 8192, 128), (64, 1000, 64)):
        for poison in POISONS:
            q, k, v = poisoned_last_row(dtype, poison, n_q, n_k, d)
            for causal in (False, True):
                o, lse = attention(q, k, v, causal=causal, return_lse=True, kernel=kernel)
                check(o.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, d ** -0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["auto", "flash", "flash_v1", "reference"])
def test_gpu_keys_of_minus_inf_on_every_kernel(kernel, dtype):
    """Whole key blocks of -inf scores, and every key -inf, on CUDA: the Hopper prefill (D 128),
    the TMA kernel (D 64) and the Gluon decode (one row over 8k keys) included."""
    for n_q, n_k, d, first in ((300, 1024, 128, 512), (300, 1024, 128, 1024), (64, 1000, 64, 512),
                               (1, 8192, 128, 4096), (1, 8192, 128, 8192)):
        q, k, v = minus_inf_keys(dtype, first, n_q=n_q, n_k=n_k, d=d, device="cuda")
        for causal in (False, True):
            o, lse = attention(q, k, v, causal=causal, return_lse=True, kernel=kernel)
            check(o.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, d ** -0.5)


@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_nan_padding_gives_the_gradients_of_clean_padding(kernel, causal, softcap):
    """Keys and values past kv_lengths may hold anything (NaN): the gradients are those of clean
    padding, and zero on the padding rows (the reference and the CPU path's dQ were all NaN: a
    masked score's dS = 0 times a NaN key; with a soft cap dK's padding rows too)."""
    if kernel == "flash_v1" and softcap:
        pytest.skip("flash_v1 takes no score modifier")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16) for n in (5, 9, 9))
    lengths = torch.tensor([6, 9], dtype=torch.int32)
    grads = []
    for pad in (0.0, NAN):
        kk, vv = k.clone(), v.clone()
        kk[0, :, 6:], vv[0, :, 6:] = pad, pad
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, vv))
        o = attention(qg, kg, vg, causal=causal, kv_lengths=lengths, kernel=kernel, softcap=softcap)
        o.backward(torch.ones_like(o))
        grads.append((o.detach(), qg.grad, kg.grad, vg.grad))
    for name, clean, poisoned in zip(("o", "dq", "dk", "dv"), *grads, strict=True):
        assert torch.equal(clean, poisoned), (name, clean, poisoned)
    assert not grads[1][2][0, :, 6:].any() and not grads[1][3][0, :, 6:].any()


def test_ragged_and_paged_calls_refuse_a_backward_instead_of_dropping_it():
    """attention_varlen and attention_paged have no backward: with inputs that require grad they
    answer (inference with grad mode on works), and a backward through the answer raises, where it
    once came back detached and a residual's backward left attention's share out without a word."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(7, 2, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    o = attention_varlen(q, k, v, cu, cu, causal=True, kernel="reference")
    with torch.no_grad():
        assert torch.equal(o, attention_varlen(q, k, v, cu, cu, causal=True, kernel="reference"))
    with pytest.raises(NotImplementedError, match="attention_varlen has no backward"):
        (q + o).sum().backward()
    pages = torch.randn(4, 2, 2, 8, requires_grad=True)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    o, lse = attention_paged(q[:2], pages, pages, table, torch.tensor([3, 4], dtype=torch.int32),
                             torch.tensor([0, 1, 2], dtype=torch.int32), kernel="reference", return_lse=True)
    assert not lse.requires_grad
    with pytest.raises(NotImplementedError, match="attention_paged has no backward"):
        o.sum().backward()


@pytest.mark.parametrize("kernel", ["reference", "cpu", "flash"], indirect=True)
def test_a_score_an_alibi_bias_pushes_past_the_kernels_range_is_infinite(kernel):
    """A bias of ±3e38 (slope ∓1e38, distance 3) takes a score past ±2.36e38: +inf (the row is
    NaN) or -inf (the key is not seen: with kv_lengths 1, o = 0 and lse = -inf) on every kernel
    (the reference and the CPU path clamped before adding the bias: a finite answer)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16)
    o, lse = attention(q, k, v, alibi_slopes=torch.tensor([-1e38]), kernel=kernel, return_lse=True)
    assert o.isnan().all() and lse.isnan().all()
    o, lse = attention(q, k, v, alibi_slopes=torch.tensor([1e38]), kv_lengths=torch.tensor([1], dtype=torch.int32),
                       kernel=kernel, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and lse.item() == -INF
