"""Probes of the forward kernels on the H200 (not a test; prints tables).

    PYTHONPATH=$PWD python3 -m bench.fwd_tma_probe              # the shipped kernels on the anchors
    PYTHONPATH=$PWD python3 -m bench.fwd_tma_probe --variants   # the first probe, below
    PYTHONPATH=$PWD python3 -m bench.fwd_tma_probe --decode     # split counts x configs for decode
    PYTHONPATH=$PWD python3 -m bench.fwd_tma_probe --host       # host us of each piece of a launch
    PYTHONPATH=$PWD python3 -m bench.fwd_tma_probe --configs    # the shipped decode plan x more configs
    PYTHONPATH=$PWD python3 -m bench.fwd_tma_probe --stages     # decode: 2 or 3 split stages x batch size

--variants prints, per shape, TFLOP/s of the production kernel, of SDPA's cuDNN and FlashAttention-2 backends,
and of each probe variant × config, every one timed by replaying a CUDA graph (kernel time only,
``do_bench`` median) and checked against SDPA. The probe kernel serves only the easy case
(contiguous q/k/v, N a multiple of BLOCK_N, no mask): it answers "is there speed to win", not
"is it correct everywhere"; the production kernel stays the one that is.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from bench.timing import graph_ms
from kernels.flash import flash_forward


@triton.jit
def _probe_fwd(Q, K, V, O, desc_q_h, desc_k_h, desc_v_h, qk_scale, Y, N,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DEVICE_DESC: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    dtype = Q.dtype.element_ty
    y = bh * N  # row of (b, h, 0) in the (B·H·N, D) view
    if DEVICE_DESC:
        desc_q = tl.make_tensor_descriptor(Q, shape=[Y, D], strides=[D, 1],
                                           block_shape=[BLOCK_M, D])
        desc_k = tl.make_tensor_descriptor(K, shape=[Y, D], strides=[D, 1],
                                           block_shape=[BLOCK_N, D])
        desc_v = tl.make_tensor_descriptor(V, shape=[Y, D], strides=[D, 1],
                                           block_shape=[BLOCK_N, D])
    else:
        desc_q = desc_q_h
        desc_k = desc_k_h
        desc_v = desc_v_h
    q = desc_q.load([y + pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in tl.range(0, N, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([y + start_n, 0]).T
        s = tl.dot(q, k)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])   # one FMA per element
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([y + start_n, 0])
        acc = tl.dot(p.to(dtype), v, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    tl.store(O + (y + offs_m)[:, None] * D + offs_d[None, :], acc.to(dtype))


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def probe(q, k, v, bm, bn, warps, stages, device_desc, ws):
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, n, d = q.shape
    o = torch.empty_like(q)
    q2, k2, v2 = (t.view(b * h * n, d) for t in (q, k, v))
    if device_desc:
        dq = dk = dv = None
    else:
        dq = TensorDescriptor(q2, q2.shape, q2.stride(), [bm, d])
        dk = TensorDescriptor(k2, k2.shape, k2.stride(), [bn, d])
        dv = TensorDescriptor(v2, v2.shape, v2.stride(), [bn, d])
    grid = (n // bm, b * h)

    def run():
        _probe_fwd[grid](q, k, v, o, dq, dk, dv, d ** -0.5 * 1.4426950408889634, b * h * n, n,
                         D=d, BLOCK_M=bm, BLOCK_N=bn, DEVICE_DESC=device_desc, WS=ws,
                         num_warps=warps, num_stages=stages)
        return o
    return run


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=20, rep=100, return_mode="median")


def _sdpa(backend, q, k, v, gqa=False, causal=False):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, is_causal=causal)


def _qkv(b, hq, hkv, n_q, n_k, d, dt):
    return (torch.randn(b, hq, n_q, d, device="cuda", dtype=dt),
            torch.randn(b, hkv, n_k, d, device="cuda", dtype=dt),
            torch.randn(b, hkv, n_k, d, device="cuda", dtype=dt))


# ---- default: the shipped kernel on the anchors (ANCHORS.md), long N, and causal at D 128

ANCHOR_ROWS = [(torch.float16, 1, 32, 1024, 128, False), (torch.float16, 1, 32, 4096, 128, False),
               (torch.float16, 1, 32, 16384, 128, False), (torch.float16, 4, 32, 1024, 64, False),
               (torch.float16, 4, 32, 4096, 64, False), (torch.float16, 4, 32, 16384, 64, False),
               (torch.float16, 16, 16, 512, 64, False), (torch.bfloat16, 1, 32, 4096, 128, False),
               (torch.bfloat16, 1, 32, 16384, 128, False), (torch.bfloat16, 4, 32, 4096, 64, False),
               (torch.float16, 1, 8, 65536, 128, False), (torch.float16, 1, 8, 131072, 128, False),
               (torch.float16, 1, 32, 1024, 128, True), (torch.float16, 1, 32, 2048, 128, True),
               (torch.float16, 1, 32, 4096, 128, True), (torch.float16, 1, 32, 16384, 128, True),
               (torch.bfloat16, 1, 32, 4096, 128, True), (torch.float16, 1, 8, 65536, 128, True)]


def anchor_row(dt, b, h, n, d, causal) -> str:
    """TFLOP/s (do_bench median, L2 flushed before each call) of flash as shipped (attn_fwd_ws in
    Gluon at D 128 on Hopper, attn_fwd_tma at D 64, where their path functions take them), flash
    with the Gluon kernel off, with both TMA kernels off, SDPA cuDNN and FA2."""
    from kernels import flash

    torch.manual_seed(0)
    q, k, v = _qkv(b, h, h, n, n, d, dt)
    sc = d ** -0.5
    provs = {
        "flash": lambda: flash_forward(q, k, v, causal=causal, scale=sc)[0],
        "no_gluon": lambda: flash_forward(q, k, v, causal=causal, scale=sc, gluon=False)[0],
        "off": lambda: flash_forward(q, k, v, causal=causal, scale=sc, tma=False)[0],
        "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal=causal),
        "fa2": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal=causal),
    }
    outs = {name: fn() for name, fn in provs.items()}  # compile and tune all before timing any
    fl = 4.0 * b * h * n * n * d / (2 if causal else 1)
    tf = {name: fl / bench_ms(fn) / 1e9 for name, fn in provs.items()}
    err = max((outs[x].float() - outs["fa2"].float()).abs().max().item() for x in ("flash", "no_gluon"))
    path = "-"
    if flash.gluon_path(q, k, v, causal, 1, 1):
        path = "gluon"
    elif flash.tma_path(q, k, v, causal, sc, 1, 1):
        path = "tma"
    return (f"| {str(dt)[6:]} | {b} | {h} | {n} | {d} | {causal} | {tf['flash']:.0f} | {tf['no_gluon']:.0f} "
            f"| {tf['off']:.0f} | {tf['cudnn']:.0f} | {tf['fa2']:.0f} | {tf['flash'] / tf['fa2']:.2f} "
            f"| {tf['flash'] / tf['cudnn']:.2f} | {path} | {err:.1e} |")


def anchors() -> None:
    print("| dtype | B | H | N | D | causal | flash | flash, gluon=False | flash, no TMA | sdpa_cudnn | sdpa_flash "
          "| flash/sdpa_flash | flash/sdpa_cudnn | path | max err vs sdpa_flash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in ANCHOR_ROWS:
        print(anchor_row(*row), flush=True)
        torch.cuda.empty_cache()


# ---- --ws: attn_fwd_tma launched raw per config, beside the bare probe kernel above

WS_ROWS = [(torch.float16, 1, 32, 4096, 128), (torch.bfloat16, 1, 32, 4096, 128),
           (torch.float16, 1, 32, 16384, 128), (torch.float16, 1, 32, 1024, 128),
           (torch.float16, 4, 32, 1024, 64), (torch.float16, 4, 32, 4096, 64)]
WS_CONFIGS = [(128, 128, 4, 2, True), (128, 128, 8, 3, False), (128, 64, 8, 3, False), (128, 128, 8, 2, True),
              (128, 64, 4, 2, True)]  # (BLOCK_M, BLOCK_N, warps, stages, warp-specialised)


def ws_row(dt, b, h, n, d) -> str:
    """Which configs keep the bare probe's speed inside the full kernel (its kv_len, ragged-block
    and epilogue code around the loop)?"""
    from kernels.jit import flash_fwd as kern
    from kernels.plan import _bucket, _no_lengths

    torch.manual_seed(0)
    q, k, v = _qkv(b, h, h, n, n, d, dt)
    ref = _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
    fl = 4.0 * b * h * n * n * d

    def run(bm, bn, w, st, ws):
        kern.attn_fwd_tma[(triton.cdiv(n, bm), b * h)](
            q, k, v, o, lse, _no_lengths(q.device), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], *lse.stride()[:2], h, 1, n, n, d ** -0.5 * kern.LOG2E, _bucket(n), _bucket(n),
            D=d, HAS_KV_LEN=False, BLOCK_M=bm, BLOCK_N=bn, WS=ws, num_warps=w, num_stages=st)
        return o

    res = []
    for bm, bn, w, st, ws in WS_CONFIGS:
        name = f"{bm}/{bn}/w{w}/s{st}{'/ws' if ws else ''}"
        try:
            err = (run(bm, bn, w, st, ws).float() - ref.float()).abs().max().item()
            t = bench_ms(lambda cfg=(bm, bn, w, st, ws): run(*cfg))
            res.append(f"{name} {fl / t / 1e9:.0f}" + ("" if err < 2e-2 else f" WRONG({err:.1g})"))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
            res.append(f"{name} fail:{type(exc).__name__}")
    bare = probe(q, k, v, 128, 128, 4, 2, True, True)
    bare()
    res.append(f"probe-ws {fl / bench_ms(bare) / 1e9:.0f}")
    return f"{str(dt)[6:]} {b}x{h}x{n}x{d}: " + ", ".join(res)


# ---- --decode: split counts x split-kernel configs (bf16, Nq 1, Hq 32 / Hkv 8, D 128)

DECODE = [(1, 8192), (1, 32768), (1, 65536), (16, 8192), (16, 32768), (16, 65536)]
SPLIT_CONFIGS = [(16, 128, 4, 2), (16, 64, 4, 3)]
SPLIT_COUNTS = (8, 16, 32)


def _host_us(fn, n=200) -> float:
    """Host time per call (no sync inside the loop): what a launch costs the CPU."""
    import time
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


@contextlib.contextmanager
def _split_configs():
    """Within: the 16-bit split kernel runs whichever single config ``_config_cells`` sets, untuned."""
    import os

    from kernels import flash
    from kernels.jit import flash_fwd as kern

    saved = kern._SPLIT_16BIT[:]
    os.environ["ATTNSERVE_AUTOTUNE"] = "0"  # the first (only) config of the list
    try:
        yield
    finally:
        kern._SPLIT_16BIT[:] = saved
        flash._compiled.clear()
        os.environ["ATTNSERVE_AUTOTUNE"] = "1"


def _config_cells(fn, ref, mb, configs) -> list[str]:
    """fn() with each split config in turn: do_bench and graph ("g") GB/s, flagged when wrong."""
    from kernels import flash
    from kernels.jit import flash_fwd as kern

    cells = []
    for bm, bn, w, st in configs:
        kern._SPLIT_16BIT[:] = [kern._cfg(bm, bn, w, st)]
        flash._compiled.clear()  # else the cached launch keeps the previous config
        try:
            err = (fn().float() - ref.float()).abs().max().item()
            cells.append(f"{bn}/w{w}/s{st} {mb / bench_ms(fn):.0f} g{mb / graph_ms(fn):.0f}"
                         + ("" if err < 1e-2 else f" WRONG{err:.1g}"))
        except Exception as exc:  # noqa: BLE001
            cells.append(f"{bn}/w{w}/s{st} fail:{type(exc).__name__}")
    return cells


def decode_rows(b, nk) -> list[str]:
    """GB/s of K and V read once: the shipped plan (normal and graph-replayed, host us per call),
    SDPA the same way, then every split count x config. ``do_bench`` clears L2 before each call."""
    from kernels import flash

    hq, hkv, d = 32, 8, 128
    q, k, v = _qkv(b, hq, hkv, 1, nk, d, torch.bfloat16)
    mb = 2 * k.numel() * k.element_size() / 1e6

    def ours(splits=None):
        return flash_forward(q, k, v, causal=False, scale=d ** -0.5, num_splits=splits)[0]

    ref = _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, gqa=True)
    plan = flash.plan(b, hq, hkv, 1, nk, q.device)
    line = []
    for name, fn in (("ours", ours),
                     ("cudnn", lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, gqa=True)),
                     ("fa2", lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, gqa=True))):
        try:
            line.append(f"{name} {mb / bench_ms(fn):.0f} (graph {mb / graph_ms(fn):.0f}, host {_host_us(fn):.0f} us)")
        except Exception as exc:  # noqa: BLE001
            line.append(f"{name} fail:{type(exc).__name__}")
    rows = [f"decode B={b} Nk={nk} ({mb:.1f} MB) plan {plan}: " + "; ".join(line)]
    with _split_configs():
        for splits in SPLIT_COUNTS:
            cells = _config_cells(lambda s=splits: ours(s), ref, mb, SPLIT_CONFIGS)
            rows.append(f"   splits {splits}: " + ", ".join(cells))
    return rows


MORE_CONFIGS = [(16, 64, 4, 3), (16, 32, 4, 4), (16, 32, 4, 6), (16, 64, 2, 3), (16, 64, 8, 3),
                (16, 64, 4, 2), (16, 128, 8, 2), (16, 64, 4, 4)]


def config_rows() -> list[str]:
    """The shipped split plan with each of MORE_CONFIGS."""
    rows = []
    with _split_configs():
        for b, nk in [(1, 8192), (16, 8192), (16, 65536)]:
            q, k, v = _qkv(b, 32, 8, 1, nk, 128, torch.bfloat16)
            mb = 2 * k.numel() * k.element_size() / 1e6
            ref = _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, gqa=True)
            fn = lambda q=q, k=k, v=v: flash_forward(q, k, v, causal=False, scale=128 ** -0.5)[0]  # noqa: E731
            rows.append(f"configs B={b} Nk={nk}: " + ", ".join(_config_cells(fn, ref, mb, MORE_CONFIGS)))
    return rows


def host_rows() -> list[str]:
    """Host us per call of each piece of a B=1, Nk=8192 decode launch (min over 5 runs of 400)."""
    from kernels import flash

    q, k, v = _qkv(1, 32, 8, 1, 8192, 128, torch.bfloat16)
    seen = {}
    real = flash.launch

    def spy(tuned, grid, args, meta, first, **kw):
        seen.update(tuned=tuned, grid=grid, args=args, meta=meta)
        return real(tuned, grid, args, meta, first, **kw)

    flash.launch = spy
    flash_forward(q, k, v, causal=False, scale=0.1)
    flash.launch = real
    compiled, cfg, tail = flash._compiled[flash._signature(seen["tuned"], seen["args"], seen["meta"], q.device)]
    g = flash._grid3(seen["grid"](cfg))
    a = seen["args"]
    pieces = {
        "flash_forward": lambda: flash_forward(q, k, v, causal=False, scale=0.1),
        "launch() (hit)": lambda: flash.launch(seen["tuned"], seen["grid"], a, seen["meta"], q),
        "_signature": lambda: flash._signature(seen["tuned"], a, seen["meta"], q.device),
        "compiled[grid](*args)": lambda: compiled[g](*a, *tail),
        "torch.empty (cuda)": lambda: torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="cuda"),
        "sdpa fa2": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, gqa=True),
        "sdpa cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, gqa=True),
    }
    return [f"host {name}: {min(_host_us(fn, 400) for _ in range(5)):.1f} us" for name, fn in pieces.items()]


STAGE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16)


def stage_rows() -> list[str]:
    """The shipped split config with 3 stages (two programs an SM) and with 2 (three), B = 1 to 16:
    do_bench and graph GB/s, and whether the two gave the same bits."""
    from kernels import flash
    from kernels.jit import flash_fwd as kern

    rows = []
    with _split_configs():
        for nk in (8192, 65536):
            for b in STAGE_BATCHES:
                q, k, v = _qkv(b, 32, 8, 1, nk, 128, torch.bfloat16)
                mb = 2 * k.numel() * k.element_size() / 1e6

                def fn(q=q, k=k, v=v):
                    return flash_forward(q, k, v, causal=False, scale=128 ** -0.5)

                cells, outs = [], []
                for st in (3, 2):
                    kern._SPLIT_16BIT[:] = [kern._cfg(16, 64, 4, st)]
                    flash._compiled.clear()
                    outs.append(fn())
                    cells.append(f"s{st} {mb / bench_ms(fn):.0f} g{mb / graph_ms(fn):.0f}")
                same = all(torch.equal(a, c) for a, c in zip(*outs, strict=True))
                rows.append(f"stages B={b} Nk={nk}: " + ", ".join(cells) + ("" if same else " BITS DIFFER"))
    return rows


# ---- --variants: the bare probe kernel (host / device descriptors, warp-specialised or not)

VARIANT_ROWS = [(torch.float16, 1, 32, 4096, 128), (torch.bfloat16, 1, 32, 4096, 128),
                (torch.float16, 1, 32, 16384, 128), (torch.float16, 4, 32, 4096, 64)]
VARIANT_CONFIGS = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 4, 2)]


def variant_rows(dt, b, h, n, d) -> list[str]:
    """TFLOP/s by CUDA-graph replay, each variant checked against SDPA."""
    torch.manual_seed(0)
    q, k, v = _qkv(b, h, h, n, n, d, dt)
    fl = 4.0 * b * h * n * n * d
    ref = _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v)
    res = {
        "flash": fl / graph_ms(lambda: flash_forward(q, k, v, causal=False, scale=d ** -0.5)) / 1e9,
        "sdpa_cudnn": fl / graph_ms(lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v)) / 1e9,
        "sdpa_flash": fl / graph_ms(lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v)) / 1e9,
    }
    rows = [f"{str(dt)[6:]} {b}x{h}x{n}x{d}:"] + [f"   {name:28s} {val:.0f}" for name, val in res.items()]
    for dev_desc, ws in ((False, False), (True, False), (True, True)):
        tag = ("dev" if dev_desc else "host") + ("+ws" if ws else "")
        for bm, bn, w, st in VARIANT_CONFIGS:
            try:
                fn = probe(q, k, v, bm, bn, w, st, dev_desc, ws)
                err = (fn().float() - ref.float()).abs().max().item()
                val = f"{fl / graph_ms(fn) / 1e9:.0f}" + ("" if err < 2e-2 else f" WRONG({err:.2g})")
            except Exception as exc:  # noqa: BLE001
                val = f"fail:{type(exc).__name__}:{str(exc)[:80]}"
            rows.append(f"   {tag} {bm}/{bn}/w{w}/s{st}".ljust(31) + val)
    return rows


def main() -> None:
    triton.set_allocator(_alloc)  # the bare probe's device-side descriptors
    modes = {
        "--configs": lambda: config_rows(),
        "--stages": lambda: stage_rows(),
        "--host": lambda: host_rows(),
        "--decode": lambda: [r for b, nk in DECODE for r in decode_rows(b, nk)],
        "--ws": lambda: [ws_row(*row) for row in WS_ROWS],
        "--variants": lambda: [r for row in VARIANT_ROWS for r in variant_rows(*row)],
    }
    asked = [m for m in modes if m in sys.argv]
    for m in asked:
        print("\n".join(modes[m]()), flush=True)
    if not asked:
        anchors()


if __name__ == "__main__":
    main()
