"""JIT-compiles the FlashInfer modules bench/paged.py uses, one tiny plan + run each, before the
bench (run it under ``timeout``): batch decode and paged prefill (causal), bf16, D 128, Hq 32,
Hkv 8, int32 indices, NHD pages, the plan arguments the bench passes. Page size and the head
group are run-time arguments, not in a module's name, so decode at page 64 finds page 16's module
(its seconds say so). Prints each step's seconds and its answer's max abs error against float32
SDPA on the gathered keys; exits 1 when a step fails.

    timeout 1500 python -m bench.flashinfer_jit
"""

import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16  # bench/paged.py's

t0 = time.monotonic()
import flashinfer  # noqa: E402 - timed: the import itself may build or load things

print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, import {time.monotonic() - t0:.1f} s",
      flush=True)
ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")  # bench.paged.fi_workspace
g = torch.Generator(device="cuda").manual_seed(0)


def pages_of(lens, page):
    """kp, vp (P, page, Hkv, D) in shuffled pages and FlashInfer's indptr, indices, last_page_len,
    built as bench.paged.paged_cache + fi_page_index do."""
    need = [math.ceil(n / page) for n in lens]
    kp, vp = (torch.randn(sum(need), page, HKV, D, device="cuda", dtype=DTYPE, generator=g) for _ in range(2))
    indices = torch.randperm(sum(need), device="cuda", generator=g).to(torch.int32)
    indptr = torch.tensor([0] + need, device="cuda").cumsum(0).to(torch.int32)
    last = torch.tensor([n - (k - 1) * page for n, k in zip(lens, need, strict=True)], dtype=torch.int32, device="cuda")
    return kp, vp, indptr, indices, last


def reference(q, kp, vp, indptr, indices, lens, n_qs):
    """float32 SDPA per sequence on its gathered keys, causal bottom-right (key j <= i + n_k - n_q)."""
    outs, at = [], 0
    for s, (n_k, n_q) in enumerate(zip(lens, n_qs, strict=True)):
        pg = indices[indptr[s]:indptr[s + 1]].long()
        k, v = (t[pg].reshape(-1, HKV, D)[:n_k].transpose(0, 1).float() for t in (kp, vp))
        qs = q[at:at + n_q].transpose(0, 1).float()
        keep = torch.arange(n_k, device="cuda")[None] <= torch.arange(n_q, device="cuda")[:, None] + n_k - n_q
        outs.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=keep, enable_gqa=True).transpose(0, 1))
        at += n_q
    return torch.cat(outs)


def decode(page):
    lens = [5, 37, 200]
    kp, vp, indptr, indices, last = pages_of(lens, page)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=DTYPE, generator=g)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=DTYPE, kv_data_type=DTYPE)
    out = w.run(q, (kp, vp))
    return out, reference(q, kp, vp, indptr, indices, lens, [1] * len(lens))


def prefill(page=64):
    lens, n_qs = [40, 300], [3, 130]
    kp, vp, indptr, indices, last = pages_of(lens, page)
    q = torch.randn(sum(n_qs), HQ, D, device="cuda", dtype=DTYPE, generator=g)
    qo = torch.tensor([0] + n_qs, device="cuda").cumsum(0).to(torch.int32)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(qo, indptr, indices, last, HQ, HKV, D, page, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(q)
    w.run(q, (kp, vp), out=out)
    print(f"  prefill backend: {getattr(w, '_backend', '?')}", flush=True)
    return out, reference(q, kp, vp, indptr, indices, lens, n_qs)


failed = 0
for name, step in [("decode page 16", lambda: decode(16)), ("decode page 64", lambda: decode(64)),
                   ("prefill paged causal page 64", prefill)]:
    t = time.monotonic()
    try:
        out, ref = step()
        torch.cuda.synchronize()
        err = (out.float() - ref).abs().max().item()
        print(f"{name}: {time.monotonic() - t:.1f} s, max abs err {err:.1e}", flush=True)
    except Exception:  # noqa: BLE001 - report each module, then the exit status
        failed += 1
        print(f"{name}: FAILED after {time.monotonic() - t:.1f} s", flush=True)
        traceback.print_exc()
print(f"total {time.monotonic() - t0:.1f} s", flush=True)
sys.exit(1 if failed else 0)
