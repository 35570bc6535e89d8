"""Numerics of the Triton forward kernels (flash, flash_v1) against a float64 reference.

On the CPU these run under TRITON_INTERPRET=1 (conftest sets it); the ``gpu`` tests repeat the
tables on CUDA with bfloat16, long sequences and the split-KV decode path. Error budget (STYLE.md
§11): the kernel's error against float64 may be at most 2x the error of plain PyTorch in the same
dtype, plus a small absolute slack.
"""

from __future__ import annotations

import pytest
import torch

from kernels import hopper, launch
from kernels.flash import flash_forward
from kernels.flash_v1 import flash_v1_forward
from kernels.reference import reference_attention
from tests.helpers import plain_attention

HAS_CUDA = torch.cuda.is_available()
# the interpreter's own numpy deprecation noise
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")
DEV = "cuda" if HAS_CUDA else "cpu"

KERNELS = {"flash": flash_forward, "flash_v1": flash_v1_forward}

# (B, Hq, Hkv, Nq, Nk, D, causal, kv_lengths) — a reason for each odd value
CASES = {
    "single_token": (1, 4, 4, 1, 1, 40, False, None),          # N = 1, D = 40: not a power of two
    "gqa_odd": (2, 8, 2, 17, 17, 59, False, None),             # Hq/Hkv = 4, N = 17, D = 59 (odd)
    "mqa_causal": (1, 5, 1, 97, 97, 72, True, None),           # 5 heads on one kv head, N = 97 prime
    "causal_nq_lt_nk": (1, 2, 2, 17, 97, 111, True, None),     # bottom-right: every row sees 80+ keys
    "causal_nq_gt_nk": (1, 2, 1, 97, 17, 40, True, None),      # rows 0..79 see no key: o = 0, lse = -inf
    "d256": (1, 2, 2, 33, 65, 256, False, None),               # the largest head dim
    "kv_lengths_zero": (3, 4, 2, 17, 97, 64, False, [0, 50, 97]),  # a batch row with no key at all
    "kv_lengths_causal": (2, 2, 2, 97, 97, 40, True, [1, 60]),     # padding and the diagonal together
    "long_kv": (1, 1, 1, 17, 1025, 72, True, None),            # N = 1025: one past a block boundary
    "long_q": (1, 1, 1, 1025, 17, 59, False, None),
}



def make(case, dtype, device=DEV, seed=0):
    b, hq, hkv, n_q, n_k, d, causal, kvl = case
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype)
               for h, n in ((hq, n_q), (hkv, n_k), (hkv, n_k)))
    kv_lengths = None if kvl is None else torch.tensor(kvl, dtype=torch.int32, device=device)
    return q, k, v, causal, d ** -0.5, kv_lengths


def check_against_reference(o, lse, q, k, v, causal, scale, kv_lengths, abs_slack=1e-5):
    ref_o, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=causal, scale=scale,
                                         kv_lengths=kv_lengths)
    plain = plain_attention(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), "o has NaN/inf (unwritten or poisoned elements)"
    err = (o.double() - ref_o).abs().max().item()
    err_plain = (plain.double() - ref_o).abs().max().item()
    assert err <= 2 * err_plain + abs_slack, f"kernel error {err:.3g} > 2 x plain PyTorch {err_plain:.3g}"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), "lse must be -inf exactly on rows that see no key"
    assert (o[dead] == 0).all(), "rows that see no key must give o = 0"
    lse_err = (lse[~dead].double() - ref_lse[~dead]).abs().max().item() if (~dead).any() else 0.0
    assert lse_err <= 1e-3 if q.dtype != torch.float32 else lse_err <= 1e-5, lse_err


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every torch.empty in the launchers starts as NaN: an element the kernel forgets stays NaN."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_fp32(kernel, name, poisoned_empty):
    q, k, v, causal, scale, kvl = make(CASES[name], torch.float32)
    o, lse = KERNELS[kernel](q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl)


FP16_CASES = ["gqa_odd", "causal_nq_gt_nk", "d256", "kv_lengths_causal"]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("name", FP16_CASES)
def test_forward_fp16(kernel, name, poisoned_empty):
    q, k, v, causal, scale, kvl = make(CASES[name], torch.float16)
    o, lse = KERNELS[kernel](q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("case", [
    (2, 8, 2, 1, 700, 72, False, [0, 513]),      # decode, GQA packed into rows, one empty row
    (1, 4, 4, 3, 900, 40, True, None),           # a few causal rows, split keys
    (2, 2, 1, 9, 600, 59, True, [600, 100]),     # causal + padding across splits
])
def test_split_kv(case, splits, poisoned_empty):
    q, k, v, causal, scale, kvl = make(case, torch.float32)
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, num_splits=splits)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_strided_bnhd_inputs(kernel):
    """A flash-attn layout tensor (B, N, H, D) transposed to (B, H, N, D) is read in place."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 33, 4, 40, generator=g).to(DEV).transpose(1, 2)
    k = torch.randn(2, 50, 2, 40, generator=g).to(DEV).transpose(1, 2)
    v = torch.randn(2, 50, 2, 40, generator=g).to(DEV).transpose(1, 2)
    assert not q.is_contiguous()
    o, lse = KERNELS[kernel](q, k, v, causal=True, scale=0.3)
    check_against_reference(o, lse, q, k, v, True, 0.3, None)


BIG_OFFSETS = """
import sys, torch
from kernels import attention
kern, dev = sys.argv[1], sys.argv[2]
buf = torch.empty(2**31 + 2**16, dtype=torch.float16, device=dev)  # on the CPU, address space only
g = torch.Generator().manual_seed(0)
q = buf.as_strided((3, 2, 8, 16), (2**30, 128, 16, 1))  # batch 2 starts at element 2**31
q.copy_(torch.randn(3, 2, 8, 16, generator=g).half())
k, v = (torch.randn(3, 2, 8, 16, generator=g).half().to(dev) for _ in range(2))
q.requires_grad_()
qc = q.detach().contiguous().requires_grad_()
o, oc = attention(q, k, v, kernel=kern, causal=True), attention(qc, k, v, kernel=kern, causal=True)
assert torch.equal(o, oc), (o - oc).abs().max()
if kern == "flash":
    do = torch.randn(o.shape, generator=g).half().to(dev)
    assert torch.equal(torch.autograd.grad(o, q, do)[0], torch.autograd.grad(oc, qc, do)[0])
print("ok")
"""


@pytest.mark.parametrize("kernel", ["flash", "flash_v1"])
def test_element_offsets_past_2_31(kernel):
    """A batch element that starts past element 2**31 (int32 strides times int32 program indices
    wrapped: a segfault in the interpreter, a wrong address on a GPU): the answer and the gradient of
    a strided view equal those of its contiguous copy. In a subprocess, as a crash would end it."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", BIG_OFFSETS, kernel, "cpu"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-2000:])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flash", "flash_v1"])
def test_gpu_element_offsets_past_2_31(kernel):
    """The same on the GPU, compiled (4 GiB of device memory): a wrapped offset reads another
    address there, so the strided answer and gradient differ from the contiguous copy's."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", BIG_OFFSETS, kernel, "cuda"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-2000:])


# ---- the TMA kernel (attn_fwd_tma): non-causal 16-bit prefill at D 64/128; its sequence-length
# threshold is lifted (tma=True) so the interpreter can run it on small shapes

TMA_CASES = {
    "ragged_gqa_empty_row": (2, 4, 2, 97, 100, 64, False, [0, 77]),  # rows past Nq clipped, keys past 77 masked
    "d128_whole_blocks": (1, 2, 1, 33, 64, 128, False, None),        # no ragged key block at all
    "one_key": (1, 2, 2, 5, 1, 64, False, None),                      # the only key block is the ragged one
}


@pytest.mark.parametrize("name", sorted(TMA_CASES))
def test_tma_kernel(name, poisoned_empty):
    q, k, v, causal, scale, kvl = make(TMA_CASES[name], torch.float16)
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl)


def test_tma_kernel_reads_bnhd_in_place():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 40, 4, 64, generator=g).to(DEV, torch.float16).transpose(1, 2)
    k = torch.randn(2, 70, 2, 64, generator=g).to(DEV, torch.float16).transpose(1, 2)
    v = torch.randn(2, 70, 2, 64, generator=g).to(DEV, torch.float16).transpose(1, 2)
    o, lse = flash_forward(q, k, v, causal=False, scale=0.2, tma=True)
    check_against_reference(o, lse, q, k, v, False, 0.2, None)


def test_tma_path_refuses_what_it_cannot_serve():
    from kernels.flash import tma_path

    q, k, v, _, scale, _ = make((1, 2, 2, 2048, 2048, 64, False, None), torch.float16)
    assert tma_path(q, k, v, False, scale, 1, 1)
    assert not tma_path(q, k, v, True, scale, 1, 1), "causal"
    assert not tma_path(q, k, v, False, -scale, 1, 1), "a negative scale (the loop's max is taken unscaled)"
    assert not tma_path(q, k, v, False, scale, 1, 2), "split-KV"
    assert not tma_path(q.float(), k.float(), v.float(), False, scale, 1, 1), "fp32"
    assert not tma_path(q[..., :40], k[..., :40], v[..., :40], False, scale, 1, 1), "D = 40"
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    q_odd = flat[1:].view(q.shape)
    assert not tma_path(q_odd, k, v, False, scale, 1, 1), "a base 2 bytes past a 16-byte boundary"
    short = q[:, :, :100]
    assert not tma_path(short, k, v, False, scale, 1, 1) and tma_path(short, k, v, False, scale, 1, 1, sizes=False)
    with pytest.raises(ValueError, match="TMA"):
        flash_forward(q[:, :, :8], k[:, :, :8], v[:, :, :8], causal=True, scale=scale, tma=True)


# ---- the Gluon kernel (attn_fwd_ws): Hopper only, and Triton's interpreter cannot run Gluon, so the
# CPU checks that it compiles for sm_90 (its API use, layouts, register budget); the GPU its numerics


_GLUON_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from kernels.jit import gluon_fwd as kg
from kernels import hopper

dtype, has_kv_len, causal, d = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4])
window, softcap, alibi = sys.argv[5] == "1", sys.argv[6] == "1", sys.argv[7] == "1"
split = int(sys.argv[8]) if len(sys.argv) > 8 else 0
pingpong = len(sys.argv) > 9 and sys.argv[9] == "1"
fn = kg.attn_fwd_ws
t = torch.empty(1, 1, 128, d, dtype=dict(fp16=torch.float16, bf16=torch.bfloat16)[dtype])
box = hopper.gluon_box(d)
block_n, o_in_q, regs = hopper.GLUON_TILES[box]
sig = dict.fromkeys(fn.arg_names, "i32")
for name, rows in dict(desc_q=64, desc_k=block_n, desc_v=block_n, desc_o=64).items():
    sig[name] = mangle_type(hopper._descriptor(t, rows, box))  # the launcher's own descriptors
sig.update(LSE="*fp32", KV_LEN="*i32", qk_scale="fp32", cap="fp32", SLOPES="*fp32")
consts = {}
for name, value in dict(HAS_KV_LEN=has_kv_len, IS_CAUSAL=causal, CONSUMER_REGS=regs, O_IN_Q=o_in_q,
                        WINDOW=window, SOFTCAP=softcap, ALIBI=alibi, SPLIT=split, PINGPONG=pingpong).items():
    sig[name] = "constexpr"
    consts[(fn.arg_names.index(name),)] = value
compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs={}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = compiled.asm["ptx"]
ops = ("wgmma.mma_async", "cp.async.bulk.tensor.4d", "setmaxnreg")
print(compiled.metadata.shared, all(op in ptx for op in ops))
"""


@pytest.mark.parametrize("dtype,has_kv_len,causal,d,window,softcap,alibi,split,pingpong", [
    ("fp16", False, False, 128, False, False, False, 0, False),
    ("bf16", True, False, 128, False, False, False, 0, False),
    ("fp16", True, True, 128, False, False, False, 0, False), ("bf16", False, True, 128, False, False, False, 0, False),
    ("bf16", True, True, 96, False, False, False, 0, False), ("fp16", False, False, 256, False, False, False, 0, False),
    ("bf16", True, True, 192, False, False, False, 0, False), ("bf16", False, True, 128, True, True, False, 0, False),
    ("fp16", True, False, 256, True, False, False, 0, False), ("bf16", False, True, 128, False, False, True, 0, False),
    ("fp16", True, False, 256, True, True, True, 0, False), ("bf16", True, True, 192, False, False, False, 64, False),
    ("fp16", False, False, 192, True, True, True, 64, False), ("bf16", False, True, 96, False, False, False, 32, False),
    ("fp16", True, False, 80, True, True, True, 16, False), ("bf16", True, False, 160, False, False, False, 32, False),
    ("bf16", False, False, 128, False, False, False, 0, True), ("fp16", True, True, 128, True, True, True, 0, True),
    ("bf16", False, True, 192, False, False, False, 64, True),
    ("bf16", True, False, 256, False, False, False, 0, True)])
def test_gluon_kernel_compiles_for_hopper(dtype, has_kv_len, causal, d, window, softcap, alibi, split, pingpong,
                                          tmp_path):
    """Compiled for sm_90 with Triton's own ptxas, no GPU needed, at each tile D (96 pads to 128,
    192 to 256, or with SPLIT runs its products over the head dim alone), with and without a
    window, softcap and ALiBi slopes, and with the consumers taking turns (within the register budget)."""
    argv = [dtype, str(int(has_kv_len)), str(int(causal)), str(d), str(int(window)), str(int(softcap)),
            str(int(alibi)), str(int(split)), str(int(pingpong))]
    shared, has_ops = _compile_for_sm90(_GLUON_COMPILE, argv, tmp_path)
    assert has_ops == "True", "expected wgmma, 4-D TMA copies and setmaxnreg in the PTX"
    assert int(shared) <= 227 * 1024  # an H200 SM's shared memory per block


def test_split_cols_names_the_columns_past_the_tiles_half(monkeypatch):
    """SPLIT = head dim - tile / 2 where that is a power of two from 16 (a 16-bit wgmma's K) and the
    dim is switched on; 0 (the whole padded tile) elsewhere."""
    from kernels import hopper

    monkeypatch.setattr(hopper, "GLUON_SPLIT_DIMS", frozenset({72, 80, 96, 112, 128, 144, 160, 192, 224, 256}))
    assert {d: hopper.split_cols(d) for d in (72, 80, 96, 112, 128, 144, 160, 192, 224, 256)} == {
        72: 0, 80: 16, 96: 32, 112: 0, 128: 0, 144: 16, 160: 32, 192: 64, 224: 0, 256: 0}
    monkeypatch.setattr(hopper, "GLUON_SPLIT_DIMS", frozenset())
    assert hopper.split_cols(192) == 0


def _compile_for_sm90(script: str, argv: list[str], tmp_path) -> list[str]:
    """Run a compile script in a process of its own (under TRITON_INTERPRET=1 a jit function is an
    interpreter object that cannot be compiled); its stdout's words."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    done = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_gluon_path_rules(monkeypatch):
    """16-bit, D a multiple of 8 from GLUON_MIN_D to 256, Hopper, causal or not, min(Nq, Nk) >=
    GLUON_MIN_N (causal: GLUON_MIN_N_CAUSAL) unless sizes=False, strides a host descriptor takes."""
    from kernels import flash

    q, k, v = (torch.empty(2, 4, 4096, 128, dtype=torch.float16) for _ in range(3))
    assert not flash.gluon_path(q, k, v, False, 1, 1), "a CPU tensor"
    monkeypatch.setattr(hopper, "_hopper", lambda device: True)
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    assert flash.gluon_path(q, k, v, False, 1, 1) and flash.gluon_path(q, k, v, True, 1, 1)
    assert not flash.gluon_path(q[..., :64], k[..., :64], v[..., :64], False, 1, 1), "D = 64: attn_fwd_tma is as fast"
    assert flash.gluon_path(q[..., :96], k[..., :96], v[..., :96], True, 1, 1), "D = 96: a slice, padded to 128"
    assert not flash.gluon_path(q[..., :100], k[..., :100], v[..., :100], False, 1, 1), "rows of 200 bytes"
    wide = torch.empty(1, 2, 4096, 256, dtype=torch.bfloat16)
    assert flash.gluon_path(wide, wide, wide, False, 1, 1) and flash.gluon_path(wide, wide, wide, True, 1, 1)
    assert [hopper.gluon_box(d) for d in (64, 72, 80, 128, 136, 192, 256, 264)] == [None, 128, 128, 128, 256,
                                                                                 256, 256, None]
    assert not flash.gluon_path(q.float(), k.float(), v.float(), False, 1, 1), "fp32"
    assert not flash.gluon_path(q, k, v, False, 1, 2) and not flash.gluon_path(q, k, v, False, 4, 1), "split, packed"
    short = q[:, :, :100]
    assert not flash.gluon_path(short, k, v, True, 1, 1) and flash.gluon_path(short, k, v, True, 1, 1, sizes=False)
    mid = q[:, :, :hopper.GLUON_MIN_N]
    assert flash.gluon_path(mid, k, v, False, 1, 1) and flash.gluon_path(mid, k, v, True, 1, 1), "a chunked prefill"
    square = k[:, :, :hopper.GLUON_MIN_N_CAUSAL - 1]
    assert flash.gluon_path(square, square, square, False, 1, 1)
    assert not flash.gluon_path(square, square, square, True, 1, 1), "causal: 2048 keys"
    assert not flash.gluon_path(q[:, :, :hopper.GLUON_MIN_N - 1], k, v, False, 1, 1)
    bnhd = torch.empty(2, 4096, 4, 128, dtype=torch.float16).transpose(1, 2)
    assert flash.gluon_path(bnhd, bnhd, bnhd, False, 1, 1)
    shared_kv = k[:1].expand(2, -1, -1, -1)  # stride 0 over B: a host descriptor cannot say it
    assert not flash.gluon_path(q, shared_kv, v, False, 1, 1)
    assert flash.gluon_path(q[:1], shared_kv[:1], v[:1], False, 1, 1), "a dim of 1 may have stride 0"
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    assert not flash.gluon_path(flat[1:].view(q.shape), k, v, False, 1, 1), "a base off a 16-byte boundary"
    assert not flash.gluon_path(q[:0], k[:0], v[:0], False, 1, 1), "an empty batch"
    from kernels.masks import Masks

    slopes = Masks(alibi=torch.ones(1, 4))
    assert flash.gluon_path(q, k, v, True, 1, 1, masks=slopes)


_DECODE_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from triton.compiler import ASTSource
from kernels.jit import gluon_decode as kd
from kernels.jit import flash_fwd as kf
from kernels import hopper

dtype, d, pack, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
fn = kd.attn_decode
t = torch.empty(1, 1, 128, d, dtype=dict(fp16=torch.float16, bf16=torch.bfloat16)[dtype])
sig = dict.fromkeys(fn.arg_names, "i32")
sig.update(desc_k=mangle_type(hopper._descriptor(t, hopper.DECODE_BLOCK_N[d])), Q="*" + dtype, O="*fp32",
           LSE="*fp32", KV_LEN="*i32", qk_scale="fp32")
sig["desc_v"] = sig["desc_k"]
consts = {}
for name, value in dict(PACK=pack, HAS_KV_LEN=True, IS_CAUSAL=causal, STAGES=hopper.DECODE_STAGES,
                       SIGNAL_MERGE=True).items():
    sig[name] = "constexpr"
    consts[(fn.arg_names.index(name),)] = value
compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs={}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = compiled.asm["ptx"]
ops = ("wgmma.mma_async", "cp.async.bulk.tensor.4d", "griddepcontrol.launch_dependents")
# the merge, launched as its programmatic dependent, waits for it
fm = kf.attn_combine
sig = dict.fromkeys(fm.arg_names, "i32")
sig.update(O_PART="*fp32", LSE_PART="*fp32", O="*" + dtype, LSE="*fp32")
consts = {}
for name, value in dict(D=d, BLOCK_D=d, BLOCK_S=16, RB=1, PDL=True).items():
    sig[name] = "constexpr"
    consts[(fm.arg_names.index(name),)] = value
merge = triton.compile(ASTSource(fn=fm, signature=sig, constexprs=consts, attrs={}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(compiled.metadata.shared, all(op in ptx for op in ops) and "griddepcontrol.wait" in merge.asm["ptx"])
"""


@pytest.mark.parametrize("dtype,d,pack,causal", [("bf16", 128, 4, False), ("fp16", 128, 1, True),
                                                 ("fp16", 64, 16, True)])
def test_decode_kernel_compiles_for_hopper(dtype, d, pack, causal, tmp_path):
    """attn_decode compiled for sm_90 as ``test_gluon_kernel_compiles_for_hopper``; two programs'
    shared memory must fit an SM, so that one's start overlaps the other's stream."""
    shared, has_ops = _compile_for_sm90(_DECODE_COMPILE, [dtype, str(d), str(pack), str(int(causal))], tmp_path)
    assert has_ops == "True", "expected wgmma, 4-D TMA copies and the merge's launch signal in the PTX"
    assert 2 * (int(shared) + 1024) <= 228 * 1024  # two blocks an SM, each with 1 KiB the system reserves


_PAGED_DECODE_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from kernels.jit import gluon_paged as kp
from kernels import hopper, ragged

dtype, d, page, causal, ws = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
fn = kp.paged_decode_ws if ws else kp.paged_decode
tdt = dict(fp16=torch.float16, bf16=torch.bfloat16)[dtype]
pages = torch.empty(4, page, 2, d, dtype=tdt)
ragged.triton_interpret = lambda: False
hopper._hopper = lambda device: True
descs, why = ragged._gluon_decode_check(torch.empty(3, 8, d, dtype=tdt), pages, pages, True,
                                        ragged.Config(16, 64, 2, 3), ragged.NO_MASKS)  # the launch's own
sig = dict.fromkeys(fn.arg_names, "i32")
sig.update(desc_k=mangle_type(descs[0]), desc_v=mangle_type(descs[1]), Q="*" + dtype, O="*" + dtype, LSE="*fp32",
           O_PART="*fp32", LSE_PART="*fp32", WORK="*i32", SEQ="*i32", BT="*i32", qk_scale="fp32")
consts = {}
for name, value in dict(PAGE=page, ROW_TILE=16, IS_CAUSAL=causal, STAGES=ragged.GLUON_DECODE_STAGES,
                        BLOCK_N=ragged.GLUON_DECODE_BLOCK_N).items():
    sig[name] = "constexpr"
    consts[(fn.arg_names.index(name),)] = value
compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs={}),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, **(dict(maxnreg=ragged.WS_MAXNREG) if ws else {})))
ptx = compiled.asm["ptx"]
rank = "2d" if page < ragged.GLUON_DECODE_BLOCK_N else "4d"
print(compiled.metadata.shared, all(op in ptx for op in ("wgmma.mma_async", f"cp.async.bulk.tensor.{rank}")))
"""


@pytest.mark.parametrize("dtype,d,page,causal,ws", [("bf16", 128, 64, True, True), ("fp16", 64, 128, False, True),
                                                    ("bf16", 128, 256, False, True), ("bf16", 128, 16, True, True),
                                                    ("fp16", 64, 32, False, True), ("bf16", 128, 16, True, False)])
def test_paged_decode_kernel_compiles_for_hopper(dtype, d, page, causal, ws, tmp_path):
    """paged_decode (Gluon) compiled for sm_90 as ``test_gluon_kernel_compiles_for_hopper``, over the
    descriptors the launch builds (pages of 16 and 32: a TMA copy per page), with its loader warp
    (``paged_decode_ws``) or without; two programs must fit an SM, as attn_decode's."""
    argv = [dtype, str(d), str(page), str(int(causal)), str(int(ws))]
    shared, has_ops = _compile_for_sm90(_PAGED_DECODE_COMPILE, argv, tmp_path)
    assert has_ops == "True", "expected wgmma and TMA copies of the descriptors' rank in the PTX"
    assert 2 * (int(shared) + 1024) <= 228 * 1024


_RAGGED_PREFILL_COMPILE = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from kernels.jit import gluon_ragged as kr
from kernels import hopper, ragged

dtype, d, page, causal, masks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
tdt = dict(fp16=torch.float16, bf16=torch.bfloat16)[dtype]
q = torch.empty(100, 8, d, dtype=tdt)
if page:
    k = torch.empty(4, page, 2, d, dtype=tdt)
else:
    k = torch.empty(100, 2, d, dtype=tdt)
ragged.triton_interpret = lambda: False
hopper._hopper = lambda device: True
(descs, regs, block_n), why = ragged._gluon_prefill_check(q, k, k, bool(page), ragged.Config(128, 128, 8, 3),
                                                          ragged.NO_MASKS)
fn = kr.ragged_prefill
sig = dict.fromkeys(fn.arg_names, "i32")
sig.update(desc_q=mangle_type(descs[0]), desc_k=mangle_type(descs[1]), desc_v=mangle_type(descs[2]),
           O="*" + dtype, LSE="*fp32", O_PART="*fp32", LSE_PART="*fp32", WORK="*i32", SEQ="*i32", BT="*i32",
           qk_scale="fp32", cap="fp32", SLOPES="*fp32")
consts = {}
for name, value in dict(PAGED=bool(page), PAGE=max(page, 1), BLOCK_N=block_n, IS_CAUSAL=causal, CONSUMER_REGS=regs,
                        WINDOW=masks, SOFTCAP=masks, ALIBI=masks).items():
    sig[name] = "constexpr"
    consts[(fn.arg_names.index(name),)] = value
compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs={}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = compiled.asm["ptx"]
rank = "2d" if 0 < page < block_n else "4d"
ops = ("wgmma.mma_async", f"cp.async.bulk.tensor.{rank}", "setmaxnreg")
print(compiled.metadata.shared, all(op in ptx for op in ops))
"""


@pytest.mark.parametrize("dtype,d,page,causal,masks", [("bf16", 128, 0, True, False), ("fp16", 128, 64, False, False),
                                                       ("bf16", 256, 0, True, True), ("bf16", 96, 256, True, True),
                                                       ("bf16", 96, 64, True, False), ("fp16", 128, 16, True, False)])
def test_ragged_prefill_kernel_compiles_for_hopper(dtype, d, page, causal, masks, tmp_path):
    """ragged_prefill (Gluon) compiled for sm_90 as ``test_gluon_kernel_compiles_for_hopper``, over
    the descriptors the launch builds: varlen keys and pages (of 64 and 16 at D 128: a TMA copy per
    page; of 64 at D 96: 64-key blocks), D 128 and 256 (96 pads to 128), with a window, softcap and
    ALiBi slopes."""
    argv = [dtype, str(d), str(page), str(int(causal)), str(int(masks))]
    shared, has_ops = _compile_for_sm90(_RAGGED_PREFILL_COMPILE, argv, tmp_path)
    assert has_ops == "True", "expected wgmma, 4-D TMA copies and setmaxnreg in the PTX"
    assert int(shared) <= 227 * 1024


def test_ragged_prefill_rules(monkeypatch):
    """ragged_prefill takes 16-bit prefill and chunk items planned in 128-row tiles at a head dim
    attn_fwd_ws takes, varlen or in pages of a multiple of 64, windows, softcap and ALiBi;
    its key blocks are attn_fwd_ws's, or 64 keys where a page holds no more."""
    from kernels import ragged
    from kernels.masks import Masks

    cfg = ragged.Config(128, 128, 8, 3)
    q = torch.empty(300, 32, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(900, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    kp, vp = (torch.empty(10, 64, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    assert ragged.gluon_prefill_refusal(q, k, v, False, cfg) in ("not sm_90", "Triton's interpreter cannot run Gluon")
    assert not ragged.gluon_plans(128, torch.bfloat16, torch.device("cpu"), False)
    monkeypatch.setattr(hopper, "_hopper", lambda device: True)
    monkeypatch.setattr(ragged, "triton_interpret", lambda: False)
    assert ragged.gluon_prefill_refusal(q, k, v, False, cfg) is None
    (descs, regs, block_n), _ = ragged.gluon_prefill_check(q, k, v, False, cfg)
    assert [d.block_shape for d in descs] == [[1, 1, 64, 128], [1, 1, 128, 128], [1, 1, 128, 128]]
    assert descs[0].shape == [1, 32, 300, 128] and descs[1].shape == [1, 8, 900, 128] and block_n == 128
    # pages of 64 at D 128: a (64, D) box per page of the (P·64, Hkv·D) view, 128-key blocks
    (descs, _, block_n), _ = ragged.gluon_prefill_check(q, kp, vp, True, cfg)
    assert descs[1].block_shape == [64, 128] and descs[1].shape == [640, 1024] and block_n == 128
    # ... at D 96 (padded to a box of 128), or not contiguous: 64-key blocks, one box each
    (descs, _, block_n), _ = ragged.gluon_prefill_check(q[..., :96], kp[..., :96], vp[..., :96], True, cfg)
    assert descs[1].block_shape == [1, 1, 64, 128] and block_n == 64
    strided = kp.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert ragged.gluon_prefill_check(q, strided, vp, True, cfg)[0][2] == 64
    assert ragged.gluon_prefill_refusal(q, kp, vp, True, cfg, Masks(left=16, right=0, softcap=5.0)) is None
    slopes = Masks(alibi=torch.ones(1, 32))
    assert ragged.gluon_prefill_refusal(q, k, v, False, cfg, slopes) is None
    small = torch.empty(40, 16, 8, 128, dtype=torch.bfloat16)
    assert ragged.gluon_prefill_check(q, small, small, True, cfg)[0][0][1].block_shape == [16, 128]
    assert "page_tokens 16" in ragged.gluon_prefill_refusal(q[..., :96], small[..., :96], small[..., :96], True, cfg)
    assert "page_tokens 48" in ragged.gluon_prefill_refusal(q, small[:, :12].repeat(1, 4, 1, 1),
                                                            small[:, :12].repeat(1, 4, 1, 1), True, cfg)
    assert "float16" in ragged.gluon_prefill_refusal(q.float(), k.float(), v.float(), False, cfg)
    assert "head_dim 64" in ragged.gluon_prefill_refusal(q[..., :64], k[..., :64], v[..., :64], False, cfg)
    assert "64 rows" in ragged.gluon_prefill_refusal(q, k, v, False, ragged.Config(64, 64, 4, 3))
    assert "no keys" in ragged.gluon_prefill_refusal(q, k[:0], v[:0], False, cfg)
    flat = torch.empty(k.numel() + 1, dtype=k.dtype)
    assert "16-byte" in ragged.gluon_prefill_refusal(q, flat[1:].view(k.shape), v, False, cfg)
    # the plan's tiles: 128 rows for prefill and chunk items where ragged_prefill may run
    assert ragged.gluon_plans(128, torch.bfloat16, torch.device("cuda"), False)
    assert not ragged.gluon_plans(64, torch.bfloat16, torch.device("cuda"), False)
    assert ragged.kernel_config("chunk", 128, torch.bfloat16, False, True).block_m == 128
    assert ragged.kernel_config("chunk", 128, torch.bfloat16, False).block_m == 64
    monkeypatch.setattr(ragged, "GLUON_PREFILL", False)
    assert "GLUON_PREFILL" in ragged.gluon_prefill_refusal(q, k, v, False, cfg)
    assert not ragged.gluon_plans(128, torch.bfloat16, torch.device("cuda"), False)


def test_paged_decode_rules(monkeypatch):
    """paged_decode takes paged 16-bit decode items at D 64 or 128 on Hopper, pages of a multiple of
    64 tokens that a descriptor takes, no score modifier; everything else stays on ragged_fwd."""
    from kernels import ragged
    from kernels.masks import Masks

    cfg = ragged.Config(16, 64, 2, 3)
    q = torch.empty(3, 32, 128, dtype=torch.bfloat16)
    kp, vp = (torch.empty(10, 64, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    assert ragged.gluon_decode_refusal(q, kp, vp, True, cfg) in ("not sm_90", "Triton's interpreter cannot run Gluon")
    monkeypatch.setattr(hopper, "_hopper", lambda device: True)
    monkeypatch.setattr(ragged, "triton_interpret", lambda: False)
    assert ragged.gluon_decode_refusal(q, kp, vp, True, cfg) is None
    assert ragged.gluon_decode_descriptors(q, kp, vp, True, cfg)[0].block_shape == [1, 1, 64, 128]
    wide = torch.empty(2, 256, 8, 64, dtype=torch.float16)
    assert ragged.gluon_decode_refusal(q[..., :64].half(), wide, wide, True, cfg) is None
    assert "no pages" in ragged.gluon_decode_refusal(q, kp[0], vp[0], False, cfg)
    small = torch.empty(40, 16, 8, 128, dtype=torch.bfloat16)
    assert ragged.gluon_decode_refusal(q, small, small, True, cfg) is None  # a TMA copy per page
    assert ragged.gluon_decode_descriptors(q, small, small, True, cfg)[0].block_shape == [16, 128]
    strided = small.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # (P, page, Hkv, D) stored head-major
    assert "contiguous" in ragged.gluon_decode_refusal(q, small, strided, True, cfg)
    tiny = torch.empty(40, 8, 8, 128, dtype=torch.bfloat16)
    assert "page_tokens 8" in ragged.gluon_decode_refusal(q, tiny, tiny, True, cfg)
    odd_page = torch.empty(40, 48, 8, 128, dtype=torch.bfloat16)
    assert "page_tokens 48" in ragged.gluon_decode_refusal(q, odd_page, odd_page, True, cfg)
    assert "float16" in ragged.gluon_decode_refusal(q.float(), kp.float(), vp.float(), True, cfg)
    odd = torch.empty(10, 64, 8, 96, dtype=torch.bfloat16)
    assert "head_dim" in ragged.gluon_decode_refusal(q[..., :96], odd, odd, True, cfg)
    assert "window" in ragged.gluon_decode_refusal(q, kp, vp, True, cfg, Masks(left=16, right=0))
    assert "64 rows" in ragged.gluon_decode_refusal(q, kp, vp, True, ragged.Config(128, 64, 4, 3))
    flat = torch.empty(kp.numel() + 1, dtype=kp.dtype)
    assert "16-byte" in ragged.gluon_decode_refusal(q, flat[1:].view(kp.shape), vp, True, cfg)
    monkeypatch.setattr(ragged, "GLUON_DECODE", False)
    assert "GLUON_DECODE" in ragged.gluon_decode_refusal(q, kp, vp, True, cfg)


def test_decode_path_rules(monkeypatch):
    """Packed or split plans, at most 64 rows a program, 16-bit, D 64 or 128, Hopper, K/V a host
    descriptor takes; q may have any strides."""
    from kernels import flash

    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(2, 8, 8192, 128, dtype=torch.bfloat16) for _ in range(2))
    assert not flash.decode_path(q, k, v, 4, 16), "a CPU tensor"
    monkeypatch.setattr(hopper, "_hopper", lambda device: True)
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    assert flash.decode_path(q, k, v, 4, 16) and flash.decode_path(q, k, v, 4, 1) and flash.decode_path(q, k, v, 1, 16)
    assert not flash.decode_path(q, k, v, 1, 1), "neither packed nor split: a prefill kernel's problem"
    assert not flash.decode_path(q.expand(2, 32, 17, 128), k, v, 4, 1), "4 x 17 rows > 64"
    assert flash.decode_path(q.expand(2, 32, 16, 128), k, v, 4, 1), "q read through pointers: stride 0 is fine"
    assert flash.decode_path(q[..., :64], k[..., :64], v[..., :64], 4, 16)
    assert not flash.decode_path(q[..., :96], k[..., :96], v[..., :96], 4, 16), "D 96"
    assert not flash.decode_path(q.float(), k.float(), v.float(), 4, 16), "fp32"
    assert not flash.decode_path(q, k[:1].expand(2, -1, -1, -1), v, 4, 16), "stride 0 over B in k"
    assert not flash.decode_path(q[:0], k[:0], v[:0], 4, 16), "an empty batch"
    bnhd = torch.empty(2, 8192, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert flash.decode_path(q, bnhd, bnhd, 4, 16)


def test_causal_heads_per_group_fit_l2(monkeypatch):
    """As many heads as have their K/V fit in twice the L2, split into even groups."""

    monkeypatch.setattr(hopper, "_l2_bytes", lambda device: 50 * 2**20)
    k = torch.empty(1, 32, 4096, 128, dtype=torch.float16)  # 2 MiB of K and V per head
    assert hopper.causal_heads_per_group(k, 32, 1) == 32, "64 MiB: all at once"
    assert hopper.causal_heads_per_group(k, 128, 1) == 43, "three even groups of <= 50"
    assert hopper.causal_heads_per_group(k, 128, 4) == 128, "GQA: four query heads read one kv head's"
    assert hopper.causal_heads_per_group(torch.empty(1, 8, 131072, 128, dtype=torch.float16), 8, 1) == 1


def test_gluon_descriptor_strides():
    """A dim of 1 gets the stride it would have if contiguous; the others keep their own."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


    bnhd = torch.empty(3, 4096, 4, 128, dtype=torch.float16).transpose(1, 2)
    d = hopper._descriptor(bnhd, 64)
    assert d.strides == [4096 * 4 * 128, 128, 4 * 128, 1] and d.block_shape == [1, 1, 64, 128]
    one = torch.empty(8, 4, 4096, 128, dtype=torch.float16)[:1, :1].expand(1, 1, -1, -1)
    assert hopper._descriptor(one, 128).strides == [4096 * 128, 4096 * 128, 128, 1]
    # stride 0 over a dim of 1 (expand of a lone head)
    lone = torch.empty(1, 1, 4096, 128, dtype=torch.float16).expand(1, 1, 4096, 128).as_strided(
        (1, 1, 4096, 128), (0, 0, 128, 1))
    assert hopper._descriptor(lone, 128).strides == [4096 * 128, 4096 * 128, 128, 1]
    for d in (hopper._descriptor(bnhd, 64), hopper._descriptor(one, 128), hopper._descriptor(lone, 128)):
        # what it skipped: Triton's own checks of these fields
        TensorDescriptor(d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding)


# ---------------------------------------------------------------- GPU


GPU_CASES = {
    **CASES,
    "prefill_4k": (1, 8, 8, 4096, 4096, 128, True, None),
    "prefill_d64": (2, 8, 8, 2048, 2048, 64, False, None),
    "gqa_long": (1, 32, 8, 1024, 3000, 128, True, [3000]),
    "decode_split": (2, 32, 8, 1, 8192, 128, False, [8192, 777]),
    "decode_mqa_1": (1, 16, 1, 1, 65536, 128, False, None),
    "tma_ragged": (2, 16, 4, 2100, 2500, 128, False, [2500, 1999]),  # a TMA kernel, chosen by size (>= 2048)
}


# every case in bf16 (the interpreter cannot check it); fp16/fp32 on a few (each is a compile)
GPU_RUNS = [(name, torch.bfloat16) for name in sorted(GPU_CASES)] + [
    (name, torch.float16) for name in ("prefill_4k", "prefill_d64", "gqa_long", "decode_split", "kv_lengths_zero",
                                       "tma_ragged")
] + [(name, torch.float32) for name in ("gqa_odd", "decode_split", "causal_nq_gt_nk")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", GPU_RUNS)
def test_gpu_flash(name, dtype, poisoned_empty):
    q, k, v, causal, scale, kvl = make(GPU_CASES[name], dtype, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3 if dtype != torch.float32 else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [(n, torch.bfloat16) for n in (
    "gqa_odd", "mqa_causal", "causal_nq_gt_nk", "kv_lengths_causal", "d256", "prefill_d64")] + [
    ("prefill_d64", torch.float16), ("long_kv", torch.float16)])
def test_gpu_flash_v1(name, dtype, poisoned_empty):
    q, k, v, causal, scale, kvl = make(GPU_CASES[name], dtype, "cuda")
    o, lse = flash_v1_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_gpu_split_counts_agree(splits):
    q, k, v, causal, scale, kvl = make(GPU_CASES["decode_split"], torch.bfloat16, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, num_splits=splits)
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
def test_gpu_launch_cache_follows_data_and_alignment():
    """Repeated launches of one signature reuse the compiled kernel (kernels.launch.launch): each
    call must still read its own tensors, and a view whose data pointer is not 16-byte aligned
    must get a kernel compiled for that, not the aligned one."""

    case = (2, 4, 2, 97, 97, 64, True, [97, 40])
    runs = []
    for seed in (1, 2):
        q, k, v, causal, scale, kvl = make(case, torch.float16, "cuda", seed=seed)
        runs.append((q, k, v, causal, scale, kvl))
    for i, (q, k, v, causal, scale, kvl) in enumerate(runs + runs):  # the second pass hits the cache
        if i == len(runs):
            seen = len(launch._compiled)
        o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
        check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)
    assert len(launch._compiled) == seen
    q, k, v, causal, scale, kvl = runs[0]
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_odd = flat[1:].view(q.shape)  # 2 bytes past an aligned address
    q_odd.copy_(q)
    assert q_odd.data_ptr() % 16 != 0
    o, lse = flash_forward(q_odd, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    check_against_reference(o, lse, q_odd, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_every_tma_config(d, monkeypatch, poisoned_empty):
    """Each config the TMA kernel's autotuner may pick is checked on its own: a warp-specialised
    config gave NaN on the H200 once (128/64/w4/s3), so none is listed unseen."""
    from kernels.jit import flash_fwd as kern

    monkeypatch.setenv("ATTNSERVE_AUTOTUNE", "0")  # the first pruned config: the one patched in
    cases = [((1, 8, 8, 2048, 2048, d, False, None), torch.bfloat16),
             ((2, 8, 2, 1100, 3000, d, False, [3000, 1234]), torch.bfloat16),
             ((2, 8, 2, 1100, 3000, d, False, [3000, 0]), torch.float16)]
    for cfg in list(kern.TMA_CONFIGS[d]):
        monkeypatch.setitem(kern.TMA_CONFIGS, d, [cfg])
        launch._compiled.clear()
        for case, dtype in cases:
            q, k, v, causal, scale, kvl = make(case, dtype, "cuda")
            o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True, gluon=False)
            check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)
    launch._compiled.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("case,tma", [
    ((2, 8, 2, 2100, 2500, 64, False, [2500, 1999]), True),   # attn_fwd_tma: scratch for its descriptors
    ((2, 4, 2, 97, 97, 64, True, [97, 40]), None),           # attn_fwd
    ((2, 32, 8, 1, 3000, 128, False, [3000, 1234]), None),   # a split decode and its merge
])
def test_gpu_launches_alike_with_a_profiler_hook(case, tma):
    """Cached launches call Triton's compiled launcher directly (``launch._run``), allocating a
    kernel's global scratch themselves; with a profiler's launch hook set they go through Triton's
    own runner, which calls the hook. Both ways must give the same bits."""
    import triton

    q, k, v, causal, scale, kvl = make(case, torch.bfloat16, "cuda")
    direct = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=tma)
    seen = []
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(seen.append)
    try:
        hooked = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=tma)
    finally:
        hook.remove(seen.append)
    assert seen, "the hook saw no launch"
    assert torch.equal(direct[0], hooked[0]) and torch.equal(direct[1], hooked[1])
    check_against_reference(*direct, q, k, v, causal, scale, kvl, abs_slack=2e-3)


GLUON_CASES = {
    "ragged_gqa": (2, 16, 4, 2100, 2500, 128, False, [2500, 1999]),  # last Q and K blocks partial
    "empty_row": (2, 4, 2, 300, 700, 128, False, [0, 650]),           # kv_len 0: o = 0, lse = -inf
    "one_partial_block": (1, 4, 4, 40, 100, 128, False, None),        # the 2nd warpgroup's rows all past Nq
    "whole_blocks": (1, 8, 8, 1024, 1024, 128, False, None),
    "long_kv": (1, 2, 1, 129, 8197, 128, False, None),                # 65 key blocks: stage phases wrap
    "causal_square": (2, 8, 2, 2100, 2100, 128, True, None),          # diagonal blocks, ragged last one
    "causal_whole": (1, 4, 4, 1024, 1024, 128, True, None),
    "causal_nq_lt_nk": (1, 4, 1, 300, 1000, 128, True, None),         # bottom-right: diagonal 700 keys in
    "causal_nq_gt_nk": (1, 4, 2, 1000, 300, 128, True, None),         # rows 0..699 see no key
    "causal_kv_lengths": (3, 4, 2, 700, 700, 128, True, [700, 333, 0]),  # padding and the diagonal together
    # more tiles than SMs (non-causal: several a persistent program), tiles with no key among them
    "many_tiles": (3, 16, 4, 1100, 2100, 128, False, [2100, 0, 999]),
    "many_tiles_causal": (3, 16, 4, 2100, 2100, 128, True, [2100, 0, 1500]),
    # head dims padded to a tile's D with zeros (80, 96 -> 128; 192 -> 256) and D 256, whose O leaves
    # through the Q buffers: tiles with no key among them keep the Q hand-over in step
    "d72_long_kv": (1, 2, 1, 129, 8197, 72, False, None),
    "d80_causal_gqa": (2, 8, 2, 2100, 2100, 80, True, None),
    "d96_ragged": (2, 16, 4, 1100, 2500, 96, False, [2500, 0]),
    "d192_causal_nq_gt_nk": (1, 4, 2, 1000, 300, 192, True, None),
    "d256_one_partial_block": (1, 4, 4, 40, 100, 256, False, None),
    "d256_many_tiles": (3, 16, 4, 1100, 2100, 256, False, [2100, 0, 999]),
    "d256_many_tiles_causal": (3, 16, 4, 2100, 2100, 256, True, [2100, 0, 1500]),
}


needs_hopper = pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9,
                                  reason="the Gluon kernel runs on Hopper (sm_90) only")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(GLUON_CASES))
def test_gpu_gluon_kernel(name, dtype, poisoned_empty, monkeypatch):
    """attn_fwd_ws, the size threshold lifted (tma=True); a spy checks that it is the kernel that ran."""
    ran = _spy(monkeypatch, "_forward_gluon")
    q, k, v, causal, scale, kvl = make(GLUON_CASES[name], dtype, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True)
    assert ran
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["d192_causal_nq_gt_nk", "d192_many_tiles", "d192_many_tiles_causal",
                                  "d96_gqa_causal", "d80_nq_gt_nk", "d160_causal_kv_lengths"])
def test_gpu_gluon_kernel_split(name, dtype, poisoned_empty, monkeypatch):
    """attn_fwd_ws with SPLIT (every candidate head dim switched on): its products over the head
    dim's columns alone, the tile's columns past it left out, against the float64 reference."""
    monkeypatch.setattr(hopper, "GLUON_SPLIT_DIMS", frozenset({80, 96, 144, 160, 192}))
    ran = _spy(monkeypatch, "_forward_gluon")
    case = SPLIT_CASES[name]
    assert hopper.split_cols(case[5]) > 0
    q, k, v, causal, scale, kvl = make(case, dtype, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True)
    assert ran
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


PINGPONG_CASES = {**{name: GLUON_CASES[name] for name in (
    "ragged_gqa", "empty_row", "one_partial_block", "long_kv", "causal_nq_gt_nk", "causal_kv_lengths", "many_tiles",
    "many_tiles_causal", "d256_many_tiles", "d256_many_tiles_causal")},
    "d64_many_tiles": (3, 16, 4, 1100, 2100, 64, False, [2100, 0, 999]),
    "d64_causal_kv_lengths": (3, 4, 2, 700, 700, 64, True, [700, 333, 0])}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(PINGPONG_CASES))
def test_gpu_gluon_kernel_pingpong(name, dtype, poisoned_empty, monkeypatch):
    """attn_fwd_ws with its consumers taking turns (PINGPONG, every tile D switched on, a tile of 64
    included) against the float64 reference: the turns stay in step over tiles of different lengths,
    tiles with no key and the phases' wrap."""
    monkeypatch.setattr(hopper, "GLUON_PINGPONG", {64, 128, 256})
    monkeypatch.setattr(hopper, "GLUON_TILES", {64: (128, False, 232), **hopper.GLUON_TILES})
    monkeypatch.setattr(hopper, "GLUON_MIN_D", 64)
    monkeypatch.setattr(hopper, "_recipes", {})
    ran = _spy(monkeypatch, "_forward_gluon")
    q, k, v, causal, scale, kvl = make(PINGPONG_CASES[name], dtype, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True)
    assert ran
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


SPLIT_CASES = {
    "d192_causal_nq_gt_nk": GLUON_CASES["d192_causal_nq_gt_nk"],
    "d192_many_tiles": (3, 16, 4, 1100, 2100, 192, False, [2100, 0, 999]),
    "d192_many_tiles_causal": (2, 8, 8, 2100, 2100, 192, True, [2100, 1500]),
    "d96_gqa_causal": (2, 12, 4, 777, 2100, 96, True, [2100, 1200]),     # 32 columns past the half
    "d80_nq_gt_nk": (1, 6, 6, 2300, 1500, 80, False, None),              # 16: one wgmma K step
    "d160_causal_kv_lengths": (2, 4, 2, 1030, 1030, 160, True, [1030, 7]),  # the 256 tile's 128 + 32
    "d144_gqa": (1, 8, 2, 1500, 2050, 144, False, None),                  # the 256 tile's 128 + 16
}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("heads_per_group", [1, 3, 64])
def test_gpu_gluon_causal_grid_orders(heads_per_group, monkeypatch, poisoned_empty):
    """The causal schedule's groups of heads (3: five groups of 3 and a last one of 1 among 16 heads;
    256 tiles): every (row block, head) runs once, and the order changes no bit."""

    q, k, v, causal, scale, kvl = make((2, 8, 2, 2000, 2100, 128, True, [2100, 640]), torch.bfloat16, "cuda")
    want = flash_forward(q, k, v, causal=True, scale=scale, kv_lengths=kvl, tma=True)
    monkeypatch.setattr(hopper, "causal_heads_per_group", lambda k, heads, group: heads_per_group)
    monkeypatch.setattr(hopper, "_recipes", {})  # the problem's kept launch has the real groups
    o, lse = flash_forward(q, k, v, causal=True, scale=scale, kv_lengths=kvl, tma=True)
    check_against_reference(o, lse, q, k, v, True, scale, kvl, abs_slack=2e-3)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 96, 256])
def test_gpu_gluon_kernel_reads_bnhd_and_batches_bit_for_bit(causal, d, monkeypatch):
    """flash-attn's (B, N, H, D) layout read in place, through the automatic choice (N >= 2048);
    each batch element's answer is its answer alone, bit for bit."""
    ran = _spy(monkeypatch, "_forward_gluon")
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(3, 2100, 8, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(3, 2300, 2, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(2))
    _batch_equals_each_alone(q, k, v, causal, 0.09, torch.tensor([2300, 2048, 7], device="cuda", dtype=torch.int32))
    assert ran == [3, 1, 1, 1]


def _spy(monkeypatch, launcher: str) -> list[int]:
    """The batch size of each call of ``hopper.<launcher>`` (one whose first argument is q): which
    kernel served a call."""
    from kernels import hopper

    ran = []
    real = getattr(hopper, launcher)
    monkeypatch.setattr(hopper, launcher, lambda *a: ran.append(a[0].shape[0]) or real(*a))
    return ran


def _batch_equals_each_alone(q, k, v, causal, scale, kv_lengths):
    """The batch against float64, then each element alone: bit for bit its slice of the batch."""
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths)
    check_against_reference(o, lse, q, k, v, causal, scale, kv_lengths, abs_slack=2e-3)
    for i in range(q.shape[0]):
        o_i, lse_i = flash_forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], causal=causal, scale=scale,
                                   kv_lengths=kv_lengths[i : i + 1])
        assert torch.equal(o[i : i + 1], o_i) and torch.equal(lse[i : i + 1], lse_i)


# ---- the Gluon decode kernel (attn_decode): split-KV, K/V by TMA

DECODE_CASES = {
    "gqa_split": (2, 32, 8, 1, 8192, 128, False, [8192, 777]),     # 16 splits; one batch row ends mid-split
    "kv_len_zero": (3, 8, 2, 1, 3000, 128, False, [3000, 0, 1]),   # no key at all; a single key
    "mha_rows": (2, 4, 4, 3, 5000, 128, False, None),              # pack 1: 3 query rows of one head, split
    "gqa_causal_rows": (1, 8, 2, 5, 2000, 128, True, [1999]),     # 4 heads x 5 rows packed, a diagonal each
    "causal_nq_gt_nk": (1, 4, 1, 16, 10, 128, True, None),         # 4 heads x 16 rows, unsplit: rows 0..5 see no key
    "packed_unsplit": (2, 16, 2, 2, 300, 128, False, [300, 65]),   # Nk < 512: packed, one split, o itself
    "mqa_d64": (1, 16, 1, 1, 9000, 64, False, None),               # D 64, ragged last block
    "gqa_causal_short": (2, 8, 2, 8, 7, 64, True, None),           # row 0 sees no key: o = 0, lse = -inf
}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_gpu_decode_kernel(name, dtype, poisoned_empty, monkeypatch):
    """attn_decode where flash.plan packs or splits; a spy checks that it is the kernel that ran."""
    ran = _spy(monkeypatch, "_forward_decode")
    q, k, v, causal, scale, kvl = make(DECODE_CASES[name], dtype, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    assert ran, "attn_decode did not serve this case"
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("splits", [1, 2, 64])
def test_gpu_decode_split_counts_and_phases(splits, monkeypatch, poisoned_empty):
    """One split runs 147 key blocks through the stages (their phases wrap many times); 64 asked
    give 37 splits of 256 keys, the last 25 empty for the short batch row."""
    ran = _spy(monkeypatch, "_forward_decode")
    q, k, v, causal, scale, kvl = make((2, 8, 2, 1, 9400, 128, False, [9400, 3000]), torch.bfloat16, "cuda")
    o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, num_splits=splits)
    assert ran
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
@needs_hopper
def test_gpu_decode_again_and_in_a_graph(monkeypatch):
    """Launch after launch (37, 1, 7 splits, twice) answers the same, bit for bit, and as the
    float64 reference; a decode captured in a CUDA graph answers new inputs as an eager call does."""
    ran = _spy(monkeypatch, "_forward_decode")
    q, k, v, causal, scale, kvl = make((5, 8, 2, 1, 9400, 128, False, [9400, 3000, 0, 256, 9399]),
                                       torch.bfloat16, "cuda")
    runs = [flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, num_splits=s) for s in (64, 1, 7) * 2]
    assert len(ran) == 6
    for (o, lse), (o2, lse2) in zip(runs[:3], runs[3:], strict=True):
        check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl)
        torch.cuda.synchronize()
        assert torch.equal(o_g, o) and torch.equal(lse_g, lse)
    check_against_reference(o_g, lse_g, q, k, v, causal, scale, kvl, abs_slack=2e-3)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("kind,case", [
    ("decode", (2, 32, 8, 1, 3000, 128, False, [3000, 1234])),   # attn_decode: packed, 12 splits
    ("gluon", (2, 8, 2, 300, 520, 128, True, [520, 333])),       # attn_fwd_ws: GQA prefill
])
def test_gpu_recipe_follows_new_tensors(kind, case, monkeypatch):
    """A Gluon kernel's launch recipe is worked out on a problem's first call and kept: later calls
    of the same shapes must read their own q, k, v and kv_lengths, not the first call's; a view
    TMA cannot describe (k 8 bytes off 16-byte alignment) takes the Triton kernel instead, and the
    aligned problem its recipe again."""
    from kernels import flash

    ran = _spy(monkeypatch, "_forward_decode" if kind == "decode" else "_forward_gluon")
    b, hq, hkv, n_q, n_k = case[:5]
    for seed in range(3):
        q, k, v, causal, scale, kvl = make(case, torch.bfloat16, "cuda", seed=seed)
        kvl = kvl - seed * 100
        o, lse = flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True)
        check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)
        if kind == "decode":
            fresh = hopper._DecodeRecipe(q, k, v, kvl, causal, *flash.plan(b, hq, hkv, n_q, n_k, q.device))
        else:
            fresh = hopper._GluonRecipe(q, k, v, kvl, causal)
        o2, lse2 = fresh(q, k, v, kvl, scale)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), "a kept recipe answers as a new one"
        if kind == "decode":
            assert fresh.merge.metadata.launch_pdl, "the merge: a programmatic dependent of the split kernel"
    assert ran == [b] * 6
    wide = torch.randn(b, hkv, n_k, 128 + 4, device="cuda", dtype=torch.bfloat16)
    k_off = wide[..., 4:]  # strides of a (.., 132) tensor, 8 bytes past a 16-byte boundary
    o, lse = flash_forward(q, k_off, v, causal=causal, scale=scale, kv_lengths=kvl)
    check_against_reference(o, lse, q, k_off, v, causal, scale, kvl, abs_slack=2e-3)
    assert ran == [b] * 6, "a misaligned k cannot be a TMA descriptor"
    flash_forward(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, tma=True)
    assert ran == [b] * 7


@pytest.mark.gpu
@needs_hopper
def test_gpu_decode_kernel_reads_strided_inputs_and_batches_bit_for_bit(monkeypatch):
    """q, k, v in flash-attn's (B, N, H, D) layout, read in place; each batch element's answer is
    its answer alone, bit for bit."""
    ran = _spy(monkeypatch, "_forward_decode")
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(3, 2, 32, 128, device="cuda", generator=g, dtype=torch.float16).transpose(1, 2)
    k, v = (torch.randn(3, 6000, 8, 128, device="cuda", generator=g, dtype=torch.float16).transpose(1, 2)
            for _ in range(2))
    _batch_equals_each_alone(q, k, v, True, 0.1, torch.tensor([6000, 4097, 5], device="cuda", dtype=torch.int32))
    assert ran == [3, 1, 1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("case", ["prefill_d64", "decode_split"])  # the TMA kernel, the split-KV pair
def test_gpu_second_device_while_the_first_is_current(case):
    """kernels.attention on cuda:1 tensors from a thread whose current device is cuda:0 (what a
    multi-GPU user of the library does): Triton launches on the current device, so the entry
    point must switch to the tensors' own."""
    import kernels

    torch.cuda.set_device(0)
    q, k, v, causal, scale, kvl = make(GPU_CASES[case], torch.bfloat16, "cuda:1")
    o, lse = kernels.attention(q, k, v, causal=causal, scale=scale, kv_lengths=kvl, return_lse=True,
                               kernel="flash")
    torch.cuda.synchronize(1)
    assert o.device == q.device and torch.cuda.current_device() == 0
    check_against_reference(o, lse, q, k, v, causal, scale, kvl, abs_slack=2e-3)


def test_tma_ragged_case_takes_the_tma_kernel():
    """GPU_CASES["tma_ragged"] exists to run the TMA kernel through the automatic choice."""
    from kernels.flash import tma_path

    q, k, v, causal, scale, _ = make(GPU_CASES["tma_ragged"], torch.float16)
    assert tma_path(q, k, v, causal, scale, 1, 1)
