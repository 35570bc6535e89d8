"""The PyTorch reference and the exact CPU path against an independent float64 computation,
every validation error, and the CPU path's memory bound."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import kernels
from kernels.reference import blockwise_attention, reference_attention
from tests.conftest import random_qkv
from tests.helpers import assert_close_to_masked, assert_close_to_reference, attention64

# (B, Hq, Hkv, Nq, Nk, D): why each is awkward
SHAPES = [
    (1, 1, 1, 1, 1, 1),  # the smallest problem: one query, one key, D = 1
    (2, 4, 4, 17, 17, 40),  # odd length, D not a power of two
    (1, 8, 2, 97, 97, 59),  # GQA 4:1, prime length, odd D
    (2, 5, 1, 33, 97, 72),  # MQA, Nq < Nk (bottom-right causal shifts right)
    (1, 2, 1, 97, 33, 111),  # Nq > Nk: causal leaves the first rows with no key
    (1, 2, 2, 1, 1025, 256),  # decode-like: one query over a long cache, largest D
    (1, 1, 1, 1025, 1025, 64),  # one past a power-of-two block
]


_inputs = random_qkv


def _lengths(shape, seed=0):
    b, nk = shape[0], shape[4]
    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(0, nk + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = 0 if b > 1 else max(1, nk // 2)  # one batch entry with every key masked
    return lens


def _rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("impl", [reference_attention, blockwise_attention], ids=["reference", "blockwise"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64(impl, shape, causal, masked):
    q, k, v = _inputs(shape)
    lens = _lengths(shape) if masked else None
    scale = 0.37
    kwargs = {"block_k": 16, "max_block_elems": 4096} if impl is blockwise_attention else {}
    o, lse = impl(q, k, v, causal=causal, scale=scale, kv_lengths=lens, **kwargs)
    o64, lse64 = attention64(q, k, v, causal=causal, scale=scale, kv_lengths=lens)
    assert o.dtype == q.dtype and o.shape == q.shape[:3] + (v.shape[-1],)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64)), "rows with no visible key must give lse = -inf"
    assert (o[torch.isinf(lse)] == 0).all(), "rows with no visible key must give o = 0"
    assert _rel(o, o64) < 1e-5
    finite = torch.isfinite(lse64)
    assert torch.allclose(lse[finite].double(), lse64[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", [reference_attention, blockwise_attention], ids=["reference", "blockwise"])
def test_low_precision_within_budget_of_plain_pytorch(dtype, impl):
    """Error budget relative to PyTorch's own attention computed in the same dtype (STYLE §11)."""
    shape = (2, 4, 2, 97, 97, 72)
    q, k, v = _inputs(shape, dtype)
    o, _ = impl(q, k, v, causal=True, scale=72**-0.5)
    o64, _ = attention64(q, k, v, causal=True)
    kr = k.repeat_interleave(2, dim=1)
    vr = v.repeat_interleave(2, dim=1)
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, kr, vr, attn_mask=torch.ones(97, 97, dtype=torch.bool).tril()
    )
    assert _rel(o, o64) <= 2 * _rel(plain, o64) + 1e-4


def test_public_api_defaults_and_lse(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # auto -> the CPU path
    q, k, v = _inputs((2, 4, 2, 17, 33, 40))
    o = kernels.attention(q, k, v)
    o2, lse = kernels.attention(q, k, v, return_lse=True)
    o64, lse64 = attention64(q, k, v)
    assert torch.equal(o, o2)
    assert _rel(o, o64) < 1e-5 and _rel(lse, lse64) < 1e-5


def test_reference_supports_autograd():
    q, k, v = (t.double().requires_grad_() for t in _inputs((1, 4, 2, 9, 13, 8)))
    lens = torch.tensor([11])

    def f(q, k, v):
        return reference_attention(q, k, v, causal=True, scale=0.3, kv_lengths=lens)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def _err(**overrides):
    q, k, v = _inputs((2, 4, 2, 8, 8, 16))
    args = {"q": q, "k": k, "v": v, **overrides}
    return args


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        (_err(q=torch.randn(4, 8, 16)), kernels.ShapeError, "4 dims"),
        (_err(q=torch.randn(2, 4, 8, 16, dtype=torch.float64)), kernels.DTypeError, "float64"),
        (_err(k=torch.randn(2, 2, 8, 16).half()), kernels.DTypeError, "share one dtype"),
        (_err(v=torch.randn(2, 2, 9, 16)), kernels.ShapeError, "same shape"),
        (_err(k=torch.randn(3, 2, 8, 16), v=torch.randn(3, 2, 8, 16)), kernels.ShapeError, "batch"),
        (_err(k=torch.randn(2, 2, 8, 8), v=torch.randn(2, 2, 8, 8)), kernels.ShapeError, "head dim"),
        (_err(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16)), kernels.ShapeError, "multiple"),
        (
            _err(q=torch.randn(1, 1, 4, 257), k=torch.randn(1, 1, 4, 257), v=torch.randn(1, 1, 4, 257)),
            kernels.HeadDimError,
            "256",
        ),
        (_err(q=torch.randn(2, 0, 8, 16)), kernels.ShapeError, "at least 1"),
        (_err(kv_lengths=torch.tensor([1, 2, 3])), kernels.KVLengthsError, "shape [2]"),
        (_err(kv_lengths=torch.tensor([1.0, 2.0])), kernels.KVLengthsError, "int32"),
        (_err(kv_lengths=torch.tensor([1, 9])), kernels.KVLengthsError, "[0, 8]"),
        (_err(kv_lengths=torch.tensor([-1, 2])), kernels.KVLengthsError, "[0, 8]"),
        (_err(scale=float("nan")), kernels.OptionError, "finite"),
        (_err(kernel="fast"), kernels.KernelUnavailableError, "unknown kernel"),
    ],
)
def test_validation_errors(args, error, words, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(error) as info:
        kernels.attention(**args)
    assert words in str(info.value)
    assert isinstance(info.value, kernels.AttentionInputError)


@pytest.mark.parametrize("kernel", ["auto", "reference", "flash"])
@pytest.mark.parametrize(("q_shape", "kv_shape"), [((0, 4, 5, 16), (0, 2, 7, 16)), ((2, 4, 0, 16), (2, 2, 7, 16)),
                                                   ((2, 4, 5, 16), (2, 2, 0, 16)), ((0, 4, 0, 16), (0, 2, 0, 16))])
def test_empty_batches_and_sequences(kernel, q_shape, kv_shape):
    """B, Nq or Nk of 0, as torch's scaled_dot_product_attention takes them: o of q's shape, zeros
    where rows see no key (Nk = 0) and lse -inf, as any keyless row; gradients of the inputs' shapes,
    zero. Heads and head dim stay at least 1."""
    q = torch.randn(*q_shape, requires_grad=True)
    k, v = (torch.randn(*kv_shape, requires_grad=True) for _ in range(2))
    lengths = torch.zeros(q_shape[0], dtype=torch.int32)
    o, lse = kernels.attention(q, k, v, causal=True, return_lse=True, kernel=kernel, kv_lengths=lengths)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.equal(o, torch.zeros_like(q)) and bool((lse == -math.inf).all())
    o.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


def test_device_mismatch_is_refused():
    q, k, v = _inputs((1, 1, 1, 4, 4, 8))
    with pytest.raises(kernels.DeviceMismatchError):
        kernels.attention(q, k.to("meta"), v.to("meta"))


def test_cpu_path_memory_is_linear_in_n():
    """N = 16384: a stored S would be 1 GiB of float32; the CPU path must stay far below it."""
    script = textwrap.dedent(
        """
        import os, resource, torch
        os.environ.pop("TRITON_INTERPRET", None)
        import kernels
        n, d = 16384, 64
        q, k, v = (torch.randn(1, 1, n, d) for _ in range(3))
        torch.set_num_threads(2)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        o = kernels.attention(q, k, v, causal=True, kv_lengths=torch.tensor([n - 5]))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert torch.isfinite(o).all()
        print((peak - base) * 1024)
        """
    )
    env_out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"})
    assert env_out.returncode == 0, env_out.stderr
    extra = int(env_out.stdout.strip().splitlines()[-1])
    assert extra < 160 * 2**20, f"CPU path grew RSS by {extra / 2**20:.0f} MiB (a stored S is 1024 MiB)"


@pytest.mark.parametrize("shape", [(5, 8, 1, 1000, 64), (3, 4, 37, 37, 16), (4, 2, 9, 300, 40)],
                         ids=["decode", "prefill", "chunk"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [False, True], ids=["dense", "kv_lengths"])
def test_cpu_path_batched_is_each_alone_bit_for_bit(shape, causal, lengths):
    """The CPU server's path (torch's CPU flash kernel): an element's bits must not depend on the
    batch it came in (the kernel rounds a decode row by where it lies in the batch)."""
    from kernels.reference import cpu_attention

    b, h, nq, nk, d = shape
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (nq, nk, nk))
    kvl = torch.tensor([nk - 3 * i for i in range(b)], dtype=torch.int32) if lengths else None
    o, lse = cpu_attention(q, k, v, causal=causal, scale=d ** -0.5, kv_lengths=kvl)
    for i in range(b):
        alone = cpu_attention(q[i:i + 1].clone(), k[i:i + 1].clone(), v[i:i + 1].clone(), causal=causal,
                              scale=d ** -0.5, kv_lengths=None if kvl is None else kvl[i:i + 1])
        assert torch.equal(o[i:i + 1], alone[0]) and torch.equal(lse[i:i + 1], alone[1]), i


# 1e-46 and 1e-300 are positive but 0 in float32, the scale torch's kernel multiplies by
@pytest.mark.parametrize("scale", [-0.7, 0.0, -0.0, -1e-3, 1e-46, 1e-300])
@pytest.mark.parametrize("nq,nk,lengths", [(5, 5, False), (3, 9, False), (4, 9, True)],
                         ids=["square", "chunk", "kv_lengths"])
def test_cpu_path_causal_with_a_float32_scale_at_or_below_zero(monkeypatch, scale, nq, nk, lengths):
    """A causal call with scale <= 0 in float32 is valid (docs/api.md: any finite scale); torch's CPU
    kernel masks before it scales, so its masked scores came out NaN or +inf and every row but the
    last was NaN (a 200 with a wrong answer). The CPU path equals the float64 reference."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # kernel="auto" -> the CPU path
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (nq, nk, nk))
    kvl = torch.tensor([nk, nk - 2], dtype=torch.int32) if lengths else None
    o, lse = kernels.attention(q, k, v, causal=True, scale=scale, kv_lengths=kvl, return_lse=True)
    o64, lse64 = attention64(q.double(), k.double(), v.double(), causal=True, scale=scale, kv_lengths=kvl)
    assert torch.isfinite(o).all()
    assert (o.double() - o64).abs().max() < 1e-5
    assert (lse.double() - lse64).abs().max() < 1e-4


@pytest.mark.parametrize("switch", [None, "0"])
def test_importing_kernels_settles_mkl_vector_math_first(switch):
    """A fresh process: importing ``kernels`` has called the VML ops once on one element (unless
    ATTNSERVE_VML_WARMUP=0), and its first big multi-threaded exp is bit for bit its second."""
    code = textwrap.dedent(
        """
        import torch, kernels
        from kernels import mkl_vml
        torch.set_num_threads(max(2, torch.get_num_threads()))
        s = torch.randn(8, 512, 1024, generator=torch.Generator().manual_seed(0)) * 4
        first, second = torch.exp(s), torch.exp(s)  # the reference's softmax weights come from torch.exp
        print(mkl_vml.resolved, torch.backends.mkl.is_available(), torch.equal(first, second))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "ATTNSERVE_VML_WARMUP"}
    if switch is not None:
        env["ATTNSERVE_VML_WARMUP"] = switch
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    resolved, mkl, same = out.stdout.split()
    assert resolved == str(mkl == "True" and switch is None)
    if switch is None:
        assert same == "True"


@pytest.mark.parametrize("strided", ["q", "k", "v", "qkv"])
@pytest.mark.parametrize("causal,lengths", [(False, False), (True, False), (True, True)],
                         ids=["plain", "causal", "causal_kv_lengths"])
def test_cpu_path_reads_a_strided_last_dim(strided, causal, lengths, monkeypatch):
    """Inputs may have any strides (docs/api.md), a last dim of stride 2 included: torch's CPU kernel
    reads that dim as if its stride were 1, so such a view must reach it as a copy."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # kernel="auto" -> the CPU path
    wide = _inputs((2, 4, 2, 17, 33, 48))  # every other column of these: D 24, stride 2
    q, k, v = (w[..., ::2] if name in strided else w[..., ::2].contiguous()
               for name, w in zip("qkv", wide, strict=True))
    assert q.shape[-1] == 24 and (q.stride(-1) == 2) == ("q" in strided)
    kvl = torch.tensor([33, 20], dtype=torch.int32) if lengths else None
    o, lse = kernels.attention(q, k, v, causal=causal, kv_lengths=kvl, return_lse=True)
    assert_close_to_reference(o, q, k, v, causal=causal, kv_lengths=kvl, lse=lse)


def test_blockwise_scales_the_scores_not_q(monkeypatch):
    """|q| ~ 100 times scale 1e37 is past float32's range though every score (|k| ~ 1e-37) is not: the
    blockwise loop (the CPU path of any score modifier) scales after the dot product, as the others do."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # kernel="auto" -> the CPU path
    q, k, v = _inputs((1, 2, 2, 16, 16, 16))
    q, k, scale = q * 100, k * 1e-37, 1e37
    o = kernels.attention(q, k, v, scale=scale, window_size=(3, 3))
    assert_close_to_masked(o, q, k, v, scale=scale, window=(3, 3))
    o, _ = blockwise_attention(q, k, v, causal=False, scale=scale)
    assert_close_to_masked(o, q, k, v, scale=scale)


def _entry_points(q, k, v):
    """attention, attention_varlen and attention_paged on one problem q (1, Hq, Nq, D), k, v
    (1, Hkv, Nk, D), each a function of the options (paged: one page holding every key)."""
    qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))  # (N, H, D)
    cu_q, cu_k = (torch.tensor([0, t.shape[0]], dtype=torch.int32) for t in (qt, kt))
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([kt.shape[0]], dtype=torch.int32)
    return {
        "attention": lambda **opts: kernels.attention(q, k, v, **opts),
        "varlen": lambda **opts: kernels.attention_varlen(qt, kt, vt, cu_q, cu_k, **opts),
        "paged": lambda **opts: kernels.attention_paged(qt, kt[None], vt[None], table, lens, cu_q, **opts),
    }


@pytest.mark.parametrize("entry", ["attention", "varlen", "paged"])
@pytest.mark.parametrize(("opts", "match"), [
    (dict(scale=float("nan")), "finite"),
    (dict(scale=1e39), "float32"),          # finite in Python, inf in the kernels' float32
    (dict(scale=-3.5e38), "float32"),
    (dict(scale=3e38), "2.3e38"),           # within float32, but scale · log2(e) is not: NaN in Triton
    (dict(scale=True), "scale must be a number"),
    (dict(scale="0.5"), "scale must be a number"),
    (dict(causal="false"), "causal must be a bool"),  # a non-empty string is true: it would run causal
    (dict(causal=1), "causal must be a bool"),
    (dict(causal=None), "causal must be a bool"),
], ids=["nan", "1e39", "-3.5e38", "3e38", "bool_scale", "str_scale", "str_causal", "int_causal", "none_causal"])
def test_scale_and_causal_are_checked_alike_everywhere(entry, opts, match):
    q, k, v = _inputs((1, 4, 2, 5, 7, 16))
    with pytest.raises(kernels.OptionError, match=match):
        _entry_points(q, k, v)[entry](**opts)


@pytest.mark.parametrize("entry", ["attention", "varlen", "paged"])
def test_numpy_scalars_are_numbers_and_flags(entry):
    """numpy's float scalars are numbers and its bool a flag: the answer is the Python values' own."""
    q, k, v = _inputs((1, 4, 2, 5, 7, 16))
    call = _entry_points(q, k, v)[entry]
    want = call(scale=0.5, causal=True, softcap=2.0)
    assert torch.equal(call(scale=np.float32(0.5), causal=np.bool_(True), softcap=np.float32(2.0)), want)
