"""Gradients: the Triton backward (recomputation from the saved LSE) against float64 autograd of the
reference, on awkward shapes; the CPU and reference paths' autograd; determinism.

Error budget (STYLE.md §11): relative error ‖g - g64‖/‖g64‖ of each of dq, dk, dv at most 2x that of
plain PyTorch autograd in the same dtype, plus a small slack.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_forward import make

import kernels
from kernels.autograd import flash_attention_autograd, flash_v1_attention_autograd
from kernels.reference import cpu_attention, reference_attention
from tests.helpers import plain_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths)
CASES = {
    "gqa_odd_d": (2, 4, 2, 17, 17, 59, False, None),             # GQA: dK/dV summed over 2 heads
    "mqa_causal": (1, 5, 1, 33, 33, 40, True, None),             # 5 query heads on one kv head
    "causal_nq_lt_nk": (1, 2, 2, 17, 97, 72, True, None),        # bottom-right causal, Nq < Nk
    "causal_nq_gt_nk": (1, 2, 1, 70, 17, 40, True, None),        # rows with no key: zero gradients
    "kv_lengths": (3, 2, 2, 40, 97, 64, True, [0, 50, 97]),      # padding, an empty batch row
    "d256": (1, 1, 1, 33, 40, 256, False, None),                 # the largest head dim
    "single_row": (2, 4, 4, 1, 130, 111, False, [130, 7]),       # decode shape, odd D
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(fn, q, k, v, do, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, **kw)
    o = o[0] if isinstance(o, tuple) else o
    return torch.autograd.grad(o, (q, k, v), do)


def check_grads(fn, case, dtype, device=DEV, slack=1e-5):
    q, k, v, causal, scale, kvl = make(case, dtype, device)
    do = torch.randn_like(q)
    kw = dict(causal=causal, scale=scale, kv_lengths=kvl)
    got = grads(fn, q, k, v, do, **kw)
    want = grads(reference_attention, q.double(), k.double(), v.double(), do.double(), **kw)
    plain = grads(plain_attention, q, k, v, do, **kw)
    for name, g, w, p in zip(("dq", "dk", "dv"), got, want, plain, strict=True):
        assert g.shape == w.shape and g.dtype == dtype, name
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        err, err_plain = rel(g, w), rel(p, w)
        assert err <= 2 * err_plain + slack, f"{name}: error {err:.3g} > 2 x plain PyTorch {err_plain:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_flash_backward_fp32(name):
    check_grads(flash_attention_autograd, CASES[name], torch.float32)


@pytest.mark.parametrize("name", ["gqa_odd_d", "kv_lengths"])
def test_flash_v1_backward_fp32(name):
    check_grads(flash_v1_attention_autograd, CASES[name], torch.float32)


def test_public_attention_gradients():
    """attention(kernel="flash") and "reference" both carry gradients; flash's lse does not."""
    q, k, v, causal, scale, kvl = make(CASES["causal_nq_lt_nk"], torch.float32)
    do = torch.randn_like(q)
    for kernel in ("flash", "reference"):
        q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = kernels.attention(q1, k1, v1, causal=causal, return_lse=True, kernel=kernel)
        assert o.requires_grad and (kernel == "reference" or not lse.requires_grad)
        o.backward(do)
        assert all(torch.isfinite(x.grad).all() for x in (q1, k1, v1))


@pytest.mark.parametrize("kernel", ["flash", "flash_v1"])
def test_a_double_backward_through_the_triton_kernels_raises(kernel):
    """Their backward is not itself differentiable: a gradient penalty (create_graph=True) raises
    instead of silently leaving out the second-order term (it came back as 0)."""
    q, k, v, causal, scale, kvl = make(CASES["causal_nq_lt_nk"], torch.float32)
    q1 = q.clone().requires_grad_()
    o = kernels.attention(q1, k, v, causal=causal, kernel=kernel)
    (g,) = torch.autograd.grad(o.square().sum(), q1, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.square().sum().backward()


def test_backward_is_deterministic():
    q, k, v, causal, scale, kvl = make(CASES["mqa_causal"], torch.float32)
    do = torch.randn_like(q)
    a = grads(flash_attention_autograd, q, k, v, do, causal=causal, scale=scale)
    b = grads(flash_attention_autograd, q, k, v, do, causal=causal, scale=scale)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_path_backward(name):
    """The CPU "auto" path (torch's CPU flash kernel, blockwise where it cannot) under autograd."""
    check_grads(cpu_attention, CASES[name], torch.float32, device="cpu")


def on_strided_views(fn):
    """fn run on views of its q, k, v whose last dim has stride 2 (every other column of a wider
    tensor), the gradients flowing back to the originals."""
    def run(q, k, v, **kw):
        q, k, v = (torch.stack((t, torch.zeros_like(t)), dim=-1).flatten(-2)[..., ::2] for t in (q, k, v))
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 2
        return fn(q, k, v, **kw)
    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_path_backward_with_a_strided_last_dim(name):
    """Torch's CPU kernel reads the last dim as if its stride were 1: the CPU path copies such views,
    and its gradients reach the views' own elements."""
    check_grads(on_strided_views(cpu_attention), CASES[name], torch.float32, device="cpu")


@pytest.mark.parametrize("kernel", ["auto", "reference", "flash"])
@pytest.mark.parametrize("lengths,causal", [([0], False), ([0, 0], False), ([0], True)],
                         ids=["one", "two", "one_causal"])
def test_backward_when_no_row_sees_a_key(kernel, lengths, causal, monkeypatch):
    """kv_lengths 0 for every batch element: o = 0, still a function of q, k, v, whose gradients are
    zeros on every kernel ("auto" without the interpreter: the CPU path)."""
    if kernel == "auto":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(len(lengths), 2, n, 16, generator=g).requires_grad_() for n in (4, 6, 6))
    o = kernels.attention(q, k, v, causal=causal, kv_lengths=torch.tensor(lengths, dtype=torch.int32),
                          kernel=kernel)
    assert (o == 0).all()
    o.sum().backward()
    for name, t in zip("qkv", (q, k, v), strict=True):
        assert t.grad is not None and (t.grad == 0).all(), f"d{name}"


# ---------------------------------------------------------------- GPU

GPU_CASES = {
    **CASES,
    "n2k_d128_causal": (1, 8, 8, 2048, 2048, 128, True, None),
    "n2k_d64_gqa": (2, 16, 4, 2048, 2048, 64, False, None),
    "n1k_nq_lt_nk": (1, 8, 2, 1000, 1500, 128, True, [1500]),
}


GPU_RUNS = [("n2k_d128_causal", torch.bfloat16), ("n2k_d128_causal", torch.float16),
            ("n2k_d64_gqa", torch.bfloat16), ("n1k_nq_lt_nk", torch.bfloat16),
            ("kv_lengths", torch.float16), ("gqa_odd_d", torch.bfloat16), ("causal_nq_gt_nk", torch.bfloat16),
            ("d256", torch.bfloat16), ("kv_lengths", torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", GPU_RUNS)
def test_gpu_flash_backward(name, dtype):
    check_grads(flash_attention_autograd, GPU_CASES[name], dtype, "cuda",
                slack=1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.gpu
def test_gpu_auto_backward_and_determinism():
    q, k, v, causal, scale, kvl = make(GPU_CASES["n2k_d64_gqa"], torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    a = grads(kernels.attention, q, k, v, do, causal=True)
    b = grads(kernels.attention, q, k, v, do, causal=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- the Hopper backward (attn_bwd_ws)
# Triton's interpreter cannot run Gluon: the CPU checks that it compiles for sm_90 and which problems
# it takes; the GPU its numerics.

_BWD_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from kernels.jit import gluon_bwd as kb
from kernels import hopper, hopper_bwd

dtype, causal, d, det = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1"
fn = kb.attn_bwd_ws
t = torch.empty(1, 1, 256, d, dtype=dict(fp16=torch.float16, bf16=torch.bfloat16)[dtype])
sig = dict.fromkeys(fn.arg_names, "i32")
for name, rows in dict(desc_q=kb.BLOCK_M, desc_do=kb.BLOCK_M, desc_k=kb.BLOCK_N, desc_v=kb.BLOCK_N).items():
    sig[name] = mangle_type(hopper._descriptor(t, rows))  # the launcher's own descriptors
sig["desc_dq"] = mangle_type(hopper_bwd._dq_descriptor(torch.empty(1, 1, 256, d)))
ptr = "*" + dtype
sig.update(LSE="*fp32", DELTA="*fp32", SEM="*i32", DK=ptr, DV=ptr, qk_scale="fp32", scale="fp32")
consts = {}
for name, value in dict(IS_CAUSAL=causal, DETERMINISTIC=det, CONSUMER_REGS=hopper_bwd.CONSUMER_REGS).items():
    sig[name] = "constexpr"
    consts[(fn.arg_names.index(name),)] = value
compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs={}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = compiled.asm["ptx"]
ops = ("wgmma.mma_async", "cp.async.bulk.tensor.4d", "setmaxnreg",
       "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add")
ordered = ("ld.global.gpu.acquire", "cp.async.bulk.wait_group 0;")
print(compiled.metadata.shared, all(op in ptx for op in ops), all(op in ptx for op in ordered),
      any(op in ptx for op in ordered))
if len(sys.argv) > 5:
    open(sys.argv[5], "w").write(ptx)
"""


@pytest.mark.parametrize("dtype,causal,d,det", [("bf16", False, 128, True), ("fp16", True, 128, True),
                                                ("bf16", True, 64, False), ("fp16", False, 64, True)])
def test_gluon_backward_compiles_for_hopper(dtype, causal, d, det, tmp_path):
    """attn_bwd_ws compiled for sm_90 with Triton's own ptxas, no GPU needed: wgmma, TMA, the
    register split and dQ's TMA reduce-adds in the PTX; the semaphore's acquire and the wait for the
    adds to land only when DETERMINISTIC."""
    from test_triton_forward import _compile_for_sm90

    shared, has_ops, all_ordered, any_ordered = _compile_for_sm90(
        _BWD_COMPILE, [dtype, str(int(causal)), str(d), str(int(det))], tmp_path)
    assert has_ops == "True", "expected wgmma, 4-D TMA copies, setmaxnreg and fp32 TMA reduce-adds in the PTX"
    assert all_ordered == any_ordered == str(det)
    assert int(shared) <= 227 * 1024  # an H200 SM's shared memory per block


def test_gluon_backward_rules(monkeypatch):
    """Where GLUON_BACKWARD is on (the default): 16-bit at D 128 on Hopper (D 64 where
    BWD_HEAD_DIMS holds it), no kv_lengths or score modifiers, min(Nq, Nk) >= BWD_MIN_N unless
    sizes=False, strides a host descriptor takes."""
    from kernels import hopper, hopper_bwd, launch
    from kernels.masks import Masks

    q, k, v = (torch.empty(2, 4, 2048, 128, dtype=torch.bfloat16) for _ in range(3))
    assert hopper_bwd.bwd_refusal(q, k, v, None) in ("not sm_90", "Triton's interpreter cannot run Gluon")
    monkeypatch.setattr(hopper, "_hopper", lambda device: True)
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    assert hopper_bwd.bwd_refusal(q, k, v, None) is None
    assert "head_dim 64" in hopper_bwd.bwd_refusal(q[..., :64], k[..., :64], v[..., :64], None)
    monkeypatch.setattr(hopper_bwd, "BWD_HEAD_DIMS", (64, 128))
    assert hopper_bwd.bwd_refusal(q[..., :64], k[..., :64], v[..., :64], None) is None
    assert "head_dim 96" in hopper_bwd.bwd_refusal(q[..., :96], k[..., :96], v[..., :96], None)
    assert hopper_bwd.bwd_refusal(q.float(), k.float(), v.float(), None) == "not float16/bfloat16"
    assert hopper_bwd.bwd_refusal(q, k, v, torch.ones(2, dtype=torch.int32)) == "kv_lengths"
    assert "window" in hopper_bwd.bwd_refusal(q, k, v, None, Masks(left=8, right=0))
    short = q[:, :, :hopper_bwd.BWD_MIN_N - 1]
    assert hopper_bwd.bwd_refusal(short, k, v, None) == "min(Nq, Nk) < BWD_MIN_N"
    assert hopper_bwd.bwd_refusal(short, k, v, None, sizes=False) is None
    assert "k:" in hopper_bwd.bwd_refusal(q, k[:1].expand(2, -1, -1, -1), v, None), "stride 0 over B"
    assert hopper_bwd.bwd_refusal(q[:0], k[:0], v[:0], None).startswith("an empty tensor")
    monkeypatch.setattr(hopper_bwd, "GLUON_BACKWARD", False)
    assert hopper_bwd.bwd_refusal(q, k, v, None) == "hopper_bwd.GLUON_BACKWARD is off"


# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths): awkward sizes for the Gluon backward's blocks (64
# query rows a step, 128 keys a program, 64 a warpgroup)
GLUON_BWD_CASES = {
    "d128_gqa_ragged": (2, 4, 2, 1000, 1000, 128, False, None),   # 1000: a ragged last query and key block
    "d128_causal": (1, 4, 4, 1000, 1000, 128, True, None),
    "d64_chunk_causal": (1, 8, 2, 200, 1100, 64, True, None),     # bottom-right: 200 rows at the end of 1100 keys
    "d64_rows_without_keys": (1, 2, 1, 700, 300, 64, True, None),  # the first 400 rows see no key
    "d128_few_rows": (1, 2, 1, 130, 2000, 128, False, None),      # 16 key blocks on 3 query blocks: ranks tie
    "d64_causal_mqa": (1, 6, 1, 777, 777, 64, True, None),        # 6 query heads summed into one kv head
}


@pytest.fixture
def gluon_bwd_calls(monkeypatch):
    """Runs attn_bwd_ws on any length (BWD_MIN_N 1) and at D 64 too; the list of its calls'
    deterministic flags."""
    from kernels import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "GLUON_BACKWARD", True)
    monkeypatch.setattr(hopper_bwd, "BWD_MIN_N", 1)
    monkeypatch.setattr(hopper_bwd, "BWD_HEAD_DIMS", (64, 128))
    calls, real = [], hopper_bwd.gluon_backward

    def spy(*args, **kw):
        calls.append(hopper_bwd.DETERMINISTIC if kw.get("deterministic") is None else kw["deterministic"])
        return real(*args, **kw)
    monkeypatch.setattr(hopper_bwd, "gluon_backward", spy)
    return calls


hopper_only = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="the Gluon backward runs on Hopper (sm_90) only")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("det", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(GLUON_BWD_CASES))
def test_gpu_gluon_backward(name, dtype, det, gluon_bwd_calls, monkeypatch):
    """attn_bwd_ws against float64 autograd of the reference (the error budget), both dQ orders."""
    from kernels import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "DETERMINISTIC", det)
    check_grads(flash_attention_autograd, GLUON_BWD_CASES[name], dtype, "cuda", slack=2e-3)
    assert gluon_bwd_calls == [det], "attn_bwd_ws did not run"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("name", ["d128_gqa_ragged", "d64_chunk_causal", "d128_few_rows"])
def test_gpu_gluon_backward_is_deterministic_and_batch_invariant(name, gluon_bwd_calls):
    """Deterministic dQ: two runs bit for bit alike, and each batch element's gradients bit for bit
    those of the element alone."""
    b, hq, hkv, n_q, n_k, d, causal, _ = GLUON_BWD_CASES[name]
    q, k, v, causal, scale, _ = make((3, hq, hkv, n_q, n_k, d, causal, None), torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    kw = dict(causal=causal, scale=scale)
    first = grads(flash_attention_autograd, q, k, v, do, **kw)
    again = grads(flash_attention_autograd, q, k, v, do, **kw)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    alone = grads(flash_attention_autograd, q[1:2], k[1:2], v[1:2], do[1:2], **kw)
    assert all(torch.equal(x[1:2], y) for x, y in zip(first, alone, strict=True))
    assert gluon_bwd_calls == [True, True, True]


@pytest.mark.gpu
@hopper_only
def test_gpu_default_backward_runs_gluon_where_it_is_faster(monkeypatch):
    """With nothing lifted, a 16-bit D 128 backward of 2048 rows and keys runs attn_bwd_ws, in order,
    within the error budget; D 64 and 1024 rows stay on the Triton kernels."""
    from kernels import hopper_bwd

    calls, real = [], hopper_bwd.gluon_backward
    monkeypatch.setattr(hopper_bwd, "gluon_backward", lambda *a, **kw: calls.append(q_len(a)) or real(*a, **kw))
    check_grads(flash_attention_autograd, (1, 4, 2, 2048, 2048, 128, True, None), torch.bfloat16, "cuda", slack=2e-3)
    assert calls == [2048], "the default backward did not run attn_bwd_ws"
    check_grads(flash_attention_autograd, (1, 4, 2, 2048, 2048, 64, True, None), torch.bfloat16, "cuda", slack=2e-3)
    check_grads(flash_attention_autograd, (1, 4, 2, 1024, 1024, 128, False, None), torch.bfloat16, "cuda",
                slack=2e-3)
    assert calls == [2048], "D 64 and 1024 rows belong to the Triton kernels"


def q_len(args) -> int:
    """Nq of gluon_backward's positional (do, q, k, v, ...)."""
    return args[1].shape[2]
