"""Benchmark sections of ragged and paged attention, run from bench/kernels.py (``--sections paged``):

- ragged prefill: 16 causal sequences of 128..8k tokens in one ``attention_varlen`` call, against
  one ``kernels.attention(kernel="flash")`` launch per sequence, SDPA per sequence and
  FlexAttention with a document mask (TFLOP/s of the causal FLOPs, ``do_bench`` medians);
- paged decode: B 1..256, equal and mixed lengths 1k..64k, pages of 16 and 64 tokens: GB/s of K+V
  read, device time (the kernels replayed from a CUDA graph, inputs rotated among copies that
  together exceed L2 several times), against the contiguous decode of ``kernels.attention`` at the
  same lengths (``kv_lengths`` where mixed), and the public call's wall time (its host work and
  its device-to-host copy of the lengths included). ``page64_ragged_fwd`` is the page-64 call with
  ``ragged.GLUON_DECODE`` off (the Triton kernel where the Gluon one runs). ``flex`` is compiled
  FlexAttention over the same page-64 cache: the pages as one ``[1, Hkv, P·page, D]`` key
  sequence, a BlockMask whose KV blocks are each row's pages and whose mask_mod maps a physical key
  to its logical position. ``fi_page16`` and ``fi_page64`` are FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` over the same pages, one planned wrapper per copy;
- chunked prefill against a paged cache: Nq 256..2k query rows against 4k..32k keys, against the
  contiguous causal ``kernels.attention``. ``flashinfer`` is FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper``, causal (bottom-right, as ours), over the same pages.

Each foreign provider's answer is checked against ``attention_paged``'s (its max abs error logged; a
cell reads "wrong" past 2e-2) and a provider that cannot run reads "err" with a log line saying why.
FlashInfer is optional: "n/a" where ``import flashinfer`` fails or ``BENCH_FLASHINFER=0``; it
compiles its modules with nvcc on first use (about 2 minutes on the H200): ``python -m
bench.flashinfer_jit`` builds them before the bench, so that its budget is not spent on them.
Every row logs as it finishes; ``paged.md`` in --out-dir gathers them.

Alone, ``python -m bench.paged`` sweeps what the kernels could be launched with: ``--sweep``
(``ragged_fwd``'s configs per class), ``--split-sweep`` (``SPLIT_WAVES``), ``--pipeline-sweep``
(``paged_decode``'s loader, stages and block size at pages of 16 and 64).
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.timing import rotated_ms
from kernels import attention, attention_paged, attention_varlen, ragged
from kernels.flash import flash_forward
from kernels.ragged import flash_ragged

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
L2_ROTATE = 300e6  # bytes of distinct inputs per rotation: five H200 L2s
PREFILL_LENS = [128, 8192, 512, 3000, 256, 6000, 1024, 200, 4096, 700, 2048, 1500, 5000, 384, 7000, 160]
DECODE = [  # (B, lengths: an int (equal) or (lo, hi) (mixed, seeded uniform))
    (1, 8192), (1, 65536), (16, 8192), (16, 32768), (64, 8192), (256, 1024), (256, 4096),
    (16, (1024, 65536)), (64, (1024, 16384)), (256, (1024, 8192)),
]
PAGES = [16, 64]
CHUNKS = [(4, 256, 4096), (4, 1024, 16384), (2, 2048, 32768), (4, 2048, 4096)]  # (B, Nq, Nk)
FLEX_PAGE = 64  # the cache flex reads: a compile per decode row already, page 16 would double them
TOL = 2e-2  # max abs error against attention_paged past which a foreign provider's cell reads "wrong"


def causal_flops(n_q: int, n_k: int) -> float:
    """4·Hq·D × the (query, key) pairs one causal sequence sees (bottom-right, n_q <= n_k)."""
    return 4.0 * HQ * D * (n_q * n_k - n_q * (n_q - 1) / 2)


def cu(lens, device="cuda") -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def paged_cache(lens, page: int, seed: int):
    """Pages holding each sequence's keys in shuffled pages, the block table and cache_lens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil(n / page) for n in lens]
    n_pages = sum(need)
    kp = torch.randn(n_pages, page, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    vp = torch.randn(n_pages, page, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    perm = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[at:at + n]
        at += n
    return kp, vp, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def n_copies(nbytes: float, cap: int = 8) -> int:
    return max(1, min(cap, math.ceil(L2_ROTATE / max(nbytes, 1)) + 1))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def checked_err(out: torch.Tensor, ref: torch.Tensor | None, log, what: str) -> str | None:
    """A foreign answer's max abs error against ``attention_paged``'s, as text for the log
    ("unchecked" without a reference), or None (logged) past ``TOL``: its cell reads "wrong"."""
    if ref is None:
        return "unchecked"
    err = max_err(out, ref)
    if err > TOL:
        log(f"  {what}: max abs err {err:.2e} vs attention_paged")
        return None
    return f"{err:.1e}"


def device_ms(calls, log, what: str) -> tuple[float, str]:
    """(ms, how): ``rotated_ms`` over ``calls`` where they capture in a CUDA graph, else the
    ``do_bench`` median of the first (launch host work and a flushed L2 included; logged)."""
    try:
        return rotated_ms(calls), "graph"
    except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is timed as launched
        log(f"  {what}: no graph capture ({type(exc).__name__}: {str(exc)[:120]}); do_bench median of one copy")
        torch.cuda.synchronize()
        return do_bench(calls[0], warmup=10, rep=40, return_mode="median"), "do_bench"


# ---- FlexAttention over the paged cache ----

@functools.cache
def compiled_flex():
    """``torch.compile(flex_attention)`` with static shapes: each decode row (B, pages, page size)
    compiles once, and keeps the flex decoding kernel (a symbolic batch falls back to the prefill one)."""
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)  # a compile per decode row, past the default 8
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True  # past the limit, an error, not eager flex's [B, Hq, 1, P·page] scores
    return torch.compile(flex_attention, dynamic=False)


def paged_mask_mod(p2l: torch.Tensor, cache_lens: torch.Tensor, page: int):
    """mask_mod over the physical keys: key j of the pool is row b's logical position
    p2l[b, j // page]·page + j % page (negative where the page is not row b's), kept below cache_lens[b]."""
    def mask_mod(b, h, q_idx, kv_idx):
        logical = p2l[b, kv_idx // page] * page + kv_idx % page
        return (logical >= 0) & (logical < cache_lens[b])

    return mask_mod


def flex_paged_block_mask(table: torch.Tensor, cache_lens: torch.Tensor, lens, n_pages: int, page: int,
                          full_blocks: bool = True):
    """BlockMask of B one-row queries over the P = n_pages pages seen as one key sequence of P·page.

    Each page is one KV block (BLOCK_SIZE (128, page): the row fits one Q block); row b's blocks are
    table[b, :ceil(lens[b] / page)], physical page ids. full_blocks: the pages wholly inside the row
    skip mask_mod (full_kv_*) and only a partial last page is masked; else every page is. The index
    lists have P columns, as PagedAttention.convert_logical_block_mask's: from_kv_blocks makes them
    dense over their last dim to derive the Q-side lists, so every page id must name a column."""
    from torch.nn.attention.flex_attention import BlockMask

    b, max_pages = table.shape
    dev = table.device
    need = torch.tensor([math.ceil(n / page) for n in lens], device=dev)
    n_full = torch.tensor([n // page for n in lens], device=dev)
    col = torch.arange(max_pages, device=dev).expand(b, max_pages)
    live = col < need[:, None]
    p2l = torch.full((b, n_pages), -1, dtype=torch.int32, device=dev)  # physical_to_logical
    p2l[torch.arange(b, device=dev)[:, None].expand(b, max_pages)[live], table[live].long()] = (
        col[live].to(torch.int32))
    pages = torch.zeros(b, 1, 1, n_pages, dtype=torch.int32, device=dev)
    pages[:, 0, 0, :max_pages] = table
    kw = {"BLOCK_SIZE": (128, page), "mask_mod": paged_mask_mod(p2l, cache_lens, page),
          "seq_lengths": (1, n_pages * page)}
    if not full_blocks:
        return BlockMask.from_kv_blocks(need.to(torch.int32).view(b, 1, 1), pages, **kw)
    last = torch.zeros_like(pages)
    last[:, 0, 0, 0] = table.gather(1, n_full.clamp(max=max_pages - 1)[:, None])[:, 0]
    partial = (need > n_full).to(torch.int32).view(b, 1, 1)
    return BlockMask.from_kv_blocks(partial, last, n_full.to(torch.int32).view(b, 1, 1), pages, **kw)


def flex_paged_call(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, block_mask):
    """q (B, Hq, D) over pages (P, page, Hkv, D): compiled flex_attention on q [B, Hq, 1, D] and the
    pool as [1, Hkv, P·page, D] (a view: last dim contiguous), broadcast over B by the BlockMask."""
    k, v = (t.view(-1, HKV, D).transpose(0, 1)[None] for t in (kp, vp))
    return functools.partial(compiled_flex(), q.view(q.shape[0], HQ, 1, D), k, v, block_mask=block_mask,
                             enable_gqa=True)


def flex_decode_cell(qs, caches, lens, page: int, kv_bytes: float, ref, log, what: str):
    """GB/s of K+V of compiled flex over each copy's cache (``BENCH_FLEX_FULL=0``: every page
    masked, no full blocks), or "err"/"wrong" with a log line saying why."""
    try:
        if not caches:
            raise RuntimeError("no paged cache (its build failed above)")
        full = os.environ.get("BENCH_FLEX_FULL", "1") != "0"
        calls = [flex_paged_call(q, kp, vp, flex_paged_block_mask(table, cl, lens, kp.shape[0], page, full))
                 for q, (kp, vp, table, cl) in zip(qs, caches, strict=True)]
        out = calls[0]()[:, :, 0]  # compiles here, one per (B, P, page); the other copies reuse it
        err = checked_err(out, ref, log, what)
        if err is None:
            return "wrong"
        ms, how = device_ms(calls, log, what)
        log(f"  {what}: max abs err {err} vs attention_paged, "
            f"{'full + partial' if full else 'partial'} blocks, timed by {how}")
        return round(kv_bytes / ms / 1e6)
    except Exception as exc:  # noqa: BLE001
        log(f"  {what}: {type(exc).__name__}: {str(exc)[:200]}")
        return "err"


# ---- FlashInfer (optional) ----

@functools.cache
def flashinfer_or_why():
    """(the flashinfer module, None), or (None, why it is not used)."""
    if os.environ.get("BENCH_FLASHINFER", "1") == "0":
        return None, "BENCH_FLASHINFER=0"
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install's own error
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return flashinfer, None


@functools.cache
def fi_workspace() -> torch.Tensor:
    """FlashInfer's float workspace, 128 MiB, zeroed before first use as it asks; the wrappers
    share it: their calls run one after another on one stream."""
    return torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")


def fi_page_index(table: torch.Tensor, lens, page: int):
    """FlashInfer's CSR form of a block table: indptr int32 (B + 1,) (pages per row, summed), indices
    int32 (indptr[-1],) (each row's first ceil(len / page) page ids, rows concatenated) and
    last_page_len int32 (B,) (1..page keys in a row's last page)."""
    dev = table.device
    need = [math.ceil(n / page) for n in lens]
    live = torch.arange(table.shape[1], device=dev)[None] < torch.tensor(need, device=dev)[:, None]
    last = torch.tensor([n - (k - 1) * page for n, k in zip(lens, need, strict=True)], dtype=torch.int32,
                        device=dev)
    return cu(need, device=dev), table[live].contiguous(), last


def fi_decode_cell(fi, qs, caches, lens, page: int, kv_bytes: float, ref, log, what: str):
    """GB/s of K+V of FlashInfer's batch decode over each copy's cache (one wrapper planned per
    copy, so the runs alone replay), or "err"/"wrong" with a log line saying why."""
    try:
        if not caches:
            raise RuntimeError("no paged cache (its build failed above)")
        calls = []
        for q, (kp, vp, table, _) in zip(qs, caches, strict=True):
            w = fi.BatchDecodeWithPagedKVCacheWrapper(fi_workspace(), "NHD")
            w.plan(*fi_page_index(table, lens, page), HQ, HKV, D, page, q_data_type=DTYPE, kv_data_type=DTYPE)
            calls.append(functools.partial(w.run, q, (kp, vp)))
        out = calls[0]()
        err = checked_err(out, ref, log, what)
        if err is None:
            return "wrong"
        ms, how = device_ms(calls, log, what)
        log(f"  {what}: max abs err {err} vs attention_paged, "
            f"timed by {how}")
        return round(kv_bytes / ms / 1e6)
    except Exception as exc:  # noqa: BLE001
        log(f"  {what}: {type(exc).__name__}: {str(exc)[:200]}")
        return "err"


def bench_ragged_prefill(log) -> list[dict]:
    lens = PREFILL_LENS
    q, k, v = (torch.randn(sum(lens), h, D, device="cuda", dtype=DTYPE) for h in (HQ, HKV, HKV))
    cu_s = cu(lens)
    flops = sum(causal_flops(n, n) for n in lens)
    starts = cu_s.tolist()
    views = [(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None])
             for a, b in zip(starts[:-1], starts[1:], strict=True)]
    row: dict = {"seqs": len(lens), "tokens": sum(lens)}

    def varlen():
        return attention_varlen(q, k, v, cu_s, cu_s, causal=True)

    def per_seq_flash():
        return [attention(*t, causal=True, kernel="flash") for t in views]

    def per_seq_sdpa():
        return [F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True) for t in views]

    providers = {"varlen": varlen, "flash_per_seq": per_seq_flash, "sdpa_per_seq": per_seq_sdpa}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(mask_mod, 1, 1, sum(lens), sum(lens), device="cuda")
        flex = torch.compile(flex_attention)
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        providers["flex_doc_mask"] = lambda: flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)
    except Exception as exc:  # noqa: BLE001 - a provider that cannot run says why
        row["flex_doc_mask"] = "err"
        log(f"  flex attention: {type(exc).__name__}: {str(exc)[:160]}")
    for name, fn in providers.items():
        try:
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
            row[name] = round(flops / ms / 1e9)
        except Exception as exc:  # noqa: BLE001
            row[name] = "err"
            log(f"  ragged prefill {name}: {type(exc).__name__}: {str(exc)[:160]}")
    mine = varlen()
    ref = torch.cat([o[0].transpose(0, 1) for o in per_seq_flash()])
    row["err_vs_flash"] = (mine.float() - ref.float()).abs().max().item()
    if isinstance(row.get("varlen"), int) and isinstance(row.get("flash_per_seq"), int):
        row["varlen/flash"] = round(row["varlen"] / row["flash_per_seq"], 3)
    log("  ragged prefill (TFLOP/s): " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return [row]


def decode_lengths(b: int, spec, seed: int) -> list[int]:
    if isinstance(spec, int):
        return [spec] * b
    g = torch.Generator().manual_seed(seed)
    return torch.randint(spec[0], spec[1] + 1, (b,), generator=g).tolist()


def bench_paged_decode(log, out_of_time) -> list[dict]:
    rows = []
    fi, why = flashinfer_or_why()
    if fi is None:
        log(f"  flashinfer columns n/a: {why}")
    for b, spec in DECODE:
        lens = decode_lengths(b, spec, seed=b)
        kv_bytes = 2 * sum(lens) * HKV * D * DTYPE.itemsize
        base = {"B": b, "keys": spec if isinstance(spec, int) else f"{spec[0]}..{spec[1]}"}
        if out_of_time():
            rows.append({**base, "skipped": "time"})
            continue
        copies = n_copies(kv_bytes)
        qs = [torch.randn(b, HQ, D, device="cuda", dtype=DTYPE) for _ in range(copies)]
        cu_q = cu([1] * b)
        # contiguous decode at the same lengths (kv_lengths where they differ)
        n_max = max(lens)
        row = dict(base)
        try:
            kvl = None if min(lens) == n_max else torch.tensor(lens, dtype=torch.int32, device="cuda")
            conts = [(q.view(b, HQ, 1, D),
                      torch.randn(b, HKV, n_max, D, device="cuda", dtype=DTYPE),
                      torch.randn(b, HKV, n_max, D, device="cuda", dtype=DTYPE)) for q in qs]
            calls = [functools.partial(flash_forward, *t, causal=True, scale=D ** -0.5, kv_lengths=kvl)
                     for t in conts]
            row["contiguous"] = round(kv_bytes / rotated_ms(calls) / 1e6)
            del conts, calls
        except Exception as exc:  # noqa: BLE001
            row["contiguous"] = "err"
            log(f"  decode contiguous B={b}: {type(exc).__name__}: {str(exc)[:160]}")
        torch.cuda.empty_cache()
        for page in PAGES:
            caches, ref = [], None
            try:
                caches = [paged_cache(lens, page, seed=i) for i in range(copies)]
                # device time: the plan is cached after the first call, so the launches alone replay
                calls = [functools.partial(flash_ragged, q, kp, vp, [1] * b, lens, causal=True, scale=D ** -0.5,
                                           block_table=table) for q, (kp, vp, table, _) in zip(qs, caches, strict=True)]
                row[f"page{page}"] = round(kv_bytes / rotated_ms(calls) / 1e6)
                if ragged.gluon_decode_refusal(qs[0], caches[0][0], caches[0][1], True,
                                               ragged.kernel_config("decode", D, DTYPE, False)) is None:
                    ragged.GLUON_DECODE = False  # the same items by ragged_fwd, for the record
                    try:
                        row[f"page{page}_ragged_fwd"] = round(kv_bytes / rotated_ms(calls) / 1e6)
                    finally:
                        ragged.GLUON_DECODE = True
                kp, vp, table, cl = caches[0]
                call = functools.partial(attention_paged, qs[0], kp, vp, table, cl, cu_q)
                ms = do_bench(call, warmup=10, rep=40, return_mode="median")
                row[f"page{page}_call_us"] = round(ms * 1e3, 1)
                if isinstance(row.get("contiguous"), int):
                    row[f"page{page}/contig"] = round(row[f"page{page}"] / row["contiguous"], 3)
                ref = call()  # the answer the foreign providers are checked against, first copy
                del calls
            except Exception as exc:  # noqa: BLE001
                row[f"page{page}"] = "err"
                log(f"  decode paged B={b} page={page}: {type(exc).__name__}: {str(exc)[:160]}")
            torch.cuda.empty_cache()
            if page == FLEX_PAGE:
                row["flex"] = flex_decode_cell(qs, caches, lens, page, kv_bytes, ref, log,
                                               f"decode flex B={b} page={page}")
                torch.cuda.empty_cache()
            row[f"fi_page{page}"] = "n/a" if fi is None else fi_decode_cell(
                fi, qs, caches, lens, page, kv_bytes, ref, log, f"decode flashinfer B={b} page={page}")
            del caches, ref
            torch.cuda.empty_cache()
        log("  paged decode (GB/s of K+V): " + ", ".join(f"{k}={v}" for k, v in row.items()))
        rows.append(row)
    return rows


def fi_prefill_cell(fi, q, kp, vp, table, b: int, n_q: int, n_k: int, page: int, flops: float, ref, log,
                    what: str):
    """TFLOP/s of FlashInfer's paged prefill, causal, on B rows of n_q queries against n_k keys
    (``do_bench`` median, as the ``paged`` column), or "err"/"wrong" with a log line saying why."""
    try:
        if kp is None:
            raise RuntimeError("no paged cache (its build failed above)")
        w = fi.BatchPrefillWithPagedKVCacheWrapper(fi_workspace(), "NHD")
        w.plan(cu([n_q] * b), *fi_page_index(table, [n_k] * b, page), HQ, HKV, D, page, causal=True,
               q_data_type=DTYPE, kv_data_type=DTYPE)
        out = torch.empty_like(q)
        fn = functools.partial(w.run, q, (kp, vp), out=out)  # out given: run() zero-fills a new one each call
        fn()
        err = checked_err(out, ref, log, what)
        if err is None:
            return "wrong"
        log(f"  {what}: max abs err {err} vs attention_paged, "
            f"backend {getattr(w, '_backend', '?')}")
        return round(flops / do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e9)
    except Exception as exc:  # noqa: BLE001
        log(f"  {what}: {type(exc).__name__}: {str(exc)[:200]}")
        return "err"


def bench_chunked_prefill(log, out_of_time, page: int = 64) -> list[dict]:
    rows = []
    fi, why = flashinfer_or_why()
    if fi is None:
        log(f"  flashinfer column n/a: {why}")
    for b, n_q, n_k in CHUNKS:
        row = {"B": b, "Nq": n_q, "Nk": n_k, "page": page}
        if out_of_time():
            rows.append({**row, "skipped": "time"})
            continue
        flops = b * causal_flops(n_q, n_k)
        q = kp = vp = table = ref = None
        try:
            q = torch.randn(b * n_q, HQ, D, device="cuda", dtype=DTYPE)
            kp, vp, table, cl = paged_cache([n_k] * b, page, seed=0)
            cu_q = cu([n_q] * b)
            fn = functools.partial(attention_paged, q, kp, vp, table, cl, cu_q)
            ref = fn()
            row["paged"] = round(flops / do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e9)
            q4 = q.view(b, n_q, HQ, D).transpose(1, 2)
            k4 = torch.randn(b, HKV, n_k, D, device="cuda", dtype=DTYPE)
            v4 = torch.randn(b, HKV, n_k, D, device="cuda", dtype=DTYPE)
            fc = functools.partial(attention, q4, k4, v4, causal=True, kernel="flash")
            fc()
            row["contiguous"] = round(flops / do_bench(fc, warmup=10, rep=40, return_mode="median") / 1e9)
            row["paged/contig"] = round(row["paged"] / row["contiguous"], 3)
            del k4, v4
        except Exception as exc:  # noqa: BLE001
            row.setdefault("paged", "err")
            log(f"  chunked prefill B={b} Nq={n_q} Nk={n_k}: {type(exc).__name__}: {str(exc)[:160]}")
        torch.cuda.empty_cache()
        row["flashinfer"] = "n/a" if fi is None else fi_prefill_cell(
            fi, q, kp, vp, table, b, n_q, n_k, page, flops, ref, log,
            f"chunked prefill flashinfer B={b} Nq={n_q} Nk={n_k}")
        del q, kp, vp, table, ref
        torch.cuda.empty_cache()
        log("  chunked prefill (TFLOP/s): " + ", ".join(f"{k}={v}" for k, v in row.items()))
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def bench_paged(out_dir: Path, log, out_of_time, meta: dict) -> None:
    """The three sections, logged as they go and written to ``out_dir/paged.md``."""
    t0 = time.monotonic()
    log("ragged prefill (16 causal sequences, Hq 32, Hkv 8, D 128, bf16)")
    prefill = bench_ragged_prefill(log)
    log("paged decode (Hq 32, Hkv 8, D 128, bf16)")
    decode = bench_paged_decode(log, out_of_time)
    log("chunked prefill against a paged cache")
    chunks = bench_chunked_prefill(log, out_of_time)
    text = "\n\n".join([
        "# Ragged and paged attention", f"{meta}",
        "## Ragged prefill, TFLOP/s (causal FLOPs)", _table(prefill),
        "## Paged decode, GB/s of K+V (device time, rotated inputs; `_call_us`: the public call's wall time; "
        f"`flex`: the page-{FLEX_PAGE} cache)",
        _table(decode),
        "## Chunked prefill against a paged cache, TFLOP/s", _table(chunks),
        f"section time: {time.monotonic() - t0:.0f} s",
    ])
    (out_dir / "paged.md").write_text(text + "\n")
    log(text)


# ---- launch configs of ragged_fwd (``python -m bench.paged --sweep``) ----

SWEEP_PREFILL = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                 (64, 128, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 32, 4, 3)]
SWEEP_DECODE = [(16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 8, 3), (16, 64, 2, 3),
                (16, 32, 4, 4), (16, 128, 4, 2), (16, 256, 8, 2)]


def sweep(log) -> list[dict]:
    """Each class's static config (``kernels.ragged.kernel_config``) replaced in turn, on the chunked
    prefill, ragged prefill and paged decode shapes: TFLOP/s (prefill) or GB/s (decode) of
    ``flash_ragged`` with its plan cached (device work and the launches' host work, no host read).
    The configs are ``ragged_fwd``'s, so the Gluon kernels are off while it runs."""
    import kernels.ragged as rg

    shipped = rg.kernel_config
    gluon = rg.GLUON_PREFILL, rg.GLUON_DECODE
    rg.GLUON_PREFILL = rg.GLUON_DECODE = False
    rows = []
    cases = [("chunk 4x256/4096 p64", "prefill"), ("chunk 2x2048/32768 p64", "prefill"),
             ("ragged 16 seqs", "prefill"), ("decode 16x8192 p64", "decode"), ("decode 16x8192 p16", "decode"),
             ("decode 1x8192 p64", "decode"), ("decode 64x1k..16k p64", "decode")]
    for name, cls in cases:
        if name.startswith("chunk"):
            b, n_q, n_k = (4, 256, 4096) if "256" in name else (2, 2048, 32768)
            q = torch.randn(b * n_q, HQ, D, device="cuda", dtype=DTYPE)
            kp, vp, table, _ = paged_cache([n_k] * b, 64, seed=0)
            work = b * causal_flops(n_q, n_k)
            fns = [functools.partial(flash_ragged, q, kp, vp, [n_q] * b, [n_k] * b, causal=True, scale=D ** -0.5,
                                     block_table=table)]
        elif name.startswith("ragged"):
            lens = PREFILL_LENS
            q, k, v = (torch.randn(sum(lens), h, D, device="cuda", dtype=DTYPE) for h in (HQ, HKV, HKV))
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
            work = sum(causal_flops(n, n) for n in lens)
            fns = [functools.partial(flash_ragged, q, k, v, lens, lens, causal=True, scale=D ** -0.5,
                                     k_starts=starts)]
        else:
            b = int(name.split()[1].split("x")[0])
            lens = decode_lengths(b, (1024, 16384) if ".." in name else 8192, seed=b)
            page = 16 if name.endswith("p16") else 64
            work = 2 * sum(lens) * HKV * D * DTYPE.itemsize
            copies = n_copies(work)
            qs = [torch.randn(b, HQ, D, device="cuda", dtype=DTYPE) for _ in range(copies)]
            caches = [paged_cache(lens, page, seed=i) for i in range(copies)]
            fns = [functools.partial(flash_ragged, qq, kp, vp, [1] * b, lens, causal=True, scale=D ** -0.5,
                                     block_table=t) for qq, (kp, vp, t, _) in zip(qs, caches, strict=True)]
        row: dict = {"case": name}
        for cfg in (SWEEP_PREFILL if cls == "prefill" else SWEEP_DECODE):
            def config(c, d, dtype, interpret, gluon=False, cfg=cfg, cls=cls):  # prefill configs: prefill and chunk
                if (c == "decode") == (cls == "decode"):
                    return rg.Config(*cfg)
                return shipped(c, d, dtype, interpret, gluon)

            rg.kernel_config = config
            rg.cached_plan.cache_clear()
            key = "/".join(map(str, cfg))
            try:
                for fn in fns:
                    fn()
                torch.cuda.synchronize()
                if cls == "prefill":
                    ms = do_bench(fns[0], warmup=5, rep=30, return_mode="median")
                    row[key] = round(work / ms / 1e9)
                else:
                    row[key] = round(work / rotated_ms(fns) / 1e6)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit says so
                row[key] = "err"
                log(f"  {name} {key}: {type(exc).__name__}: {str(exc)[:120]}")
        rg.kernel_config = shipped
        rg.cached_plan.cache_clear()
        log("  sweep " + ", ".join(f"{k}={v}" for k, v in row.items()))
        rows.append(row)
        del fns
        torch.cuda.empty_cache()
    rg.GLUON_PREFILL, rg.GLUON_DECODE = gluon
    return rows


def _keys(spec) -> int | str:
    return spec if isinstance(spec, int) else f"{spec[0]}..{spec[1]}"


def _decode_inputs(b: int, spec) -> tuple[list[int], int, list[torch.Tensor]]:
    """A decode row's lengths, its K+V bytes and its query copies (rotated past L2)."""
    lens = decode_lengths(b, spec, seed=b)
    work = 2 * sum(lens) * HKV * D * DTYPE.itemsize
    return lens, work, [torch.randn(b, HQ, D, device="cuda", dtype=DTYPE) for _ in range(n_copies(work))]


def _paged_calls(qs: list[torch.Tensor], lens: list[int], page: int) -> tuple[list, list]:
    """(the paged caches, one ``flash_ragged`` decode call over each), a cache per query copy."""
    caches = [paged_cache(lens, page, seed=i) for i in range(len(qs))]
    fns = [functools.partial(flash_ragged, qq, kp, vp, [1] * len(lens), lens, causal=True, scale=D ** -0.5,
                             block_table=t) for qq, (kp, vp, t, _) in zip(qs, caches, strict=True)]
    return caches, fns


def split_sweep(log, waves=(1, 2, 3, 4)) -> list[dict]:
    """The paged decode rows at each ``kernels.ragged.SPLIT_WAVES`` (how many waves of programs a
    short sequence's key splits fill): GB/s of K+V, device time, rotated inputs, plan cached."""
    import kernels.ragged as rg

    shipped = rg.SPLIT_WAVES
    rows = []
    for b, spec in DECODE:
        lens, work, qs = _decode_inputs(b, spec)
        for page in PAGES:
            caches, fns = _paged_calls(qs, lens, page)
            row: dict = {"B": b, "keys": _keys(spec), "page": page}
            for w in waves:
                rg.SPLIT_WAVES = w
                rg.sequence_plan.cache_clear()
                rg.cached_plan.cache_clear()
                splits = rg.sequence_plan(1, lens[0], HQ, HKV, (16, 128, 64), rg.num_sms(torch.device("cuda")))[2]
                for fn in fns:
                    fn()
                torch.cuda.synchronize()
                row[f"waves{w}"] = round(work / rotated_ms(fns) / 1e6)
                row[f"splits{w}"] = splits
            rg.SPLIT_WAVES = shipped
            rg.sequence_plan.cache_clear()
            rg.cached_plan.cache_clear()
            log("  split sweep " + ", ".join(f"{k}={v}" for k, v in row.items()))
            rows.append(row)
            del caches, fns
            torch.cuda.empty_cache()
    return rows


# paged_decode's (loader warp, K/V blocks in flight, keys a block)
PIPELINES = [(False, 2, 64), (True, 2, 64), (True, 3, 64)]


def pipeline_sweep(log, pipelines=PIPELINES, pages=(16, 64)) -> list[dict]:
    """The paged decode rows at each page size of ``pages`` with each pipeline in turn: the loader
    warp of ``paged_decode_ws`` or ``paged_decode``'s copies issued by its consumers, whatever
    ``ragged.GLUON_DECODE_LOADER`` picks; ``GLUON_DECODE_STAGES``; ``GLUON_DECODE_BLOCK_N``. GB/s of
    K+V, device time, rotated inputs, medians of three; ``contiguous``: ``flash``'s decode."""
    import kernels.ragged as rg

    shipped = rg.GLUON_DECODE_LOADER, rg.GLUON_DECODE_STAGES, rg.GLUON_DECODE_BLOCK_N
    rows = []
    for b, spec in DECODE:
        lens, work, qs = _decode_inputs(b, spec)
        n_max = max(lens)
        kvl = None if min(lens) == n_max else torch.tensor(lens, dtype=torch.int32, device="cuda")
        conts = [(qq.view(b, HQ, 1, D), torch.randn(b, HKV, n_max, D, device="cuda", dtype=DTYPE),
                  torch.randn(b, HKV, n_max, D, device="cuda", dtype=DTYPE)) for qq in qs]
        fns = [functools.partial(flash_forward, *t, causal=True, scale=D ** -0.5, kv_lengths=kvl) for t in conts]
        contiguous = round(work / rotated_ms(fns) / 1e6)
        del conts, fns
        for page in pages:
            row: dict = {"B": b, "keys": _keys(spec), "page": page, "contiguous": contiguous}
            caches, fns = _paged_calls(qs, lens, page)
            ref = fns[0]()[0].float()
            try:
                for loader, stages, block_n in pipelines:
                    rg.GLUON_DECODE_LOADER = page if loader else 0
                    rg.GLUON_DECODE_STAGES, rg.GLUON_DECODE_BLOCK_N = stages, block_n
                    err = (fns[0]()[0].float() - ref).abs().max().item()
                    gbs = round(work / statistics.median(rotated_ms(fns) for _ in range(3)) / 1e6)
                    name = f"{'ws' if loader else 'plain'}_s{stages}_n{block_n}"
                    row[name] = gbs if err < 1e-2 else f"wrong ({err:.1e})"
            finally:
                rg.GLUON_DECODE_LOADER, rg.GLUON_DECODE_STAGES, rg.GLUON_DECODE_BLOCK_N = shipped
            log("  pipeline sweep " + ", ".join(f"{k}={v}" for k, v in row.items()))
            rows.append(row)
            del caches, fns
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="ragged_fwd's launch configs and split counts on the paged section's "
                                             "shapes")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sweep", action="store_true", help="each class's launch config replaced in turn")
    mode.add_argument("--split-sweep", action="store_true", help="the decode rows at SPLIT_WAVES 1..4")
    mode.add_argument("--pipeline-sweep", action="store_true",
                      help="the decode rows at pages of 16 and 64 with each of paged_decode's pipelines")
    ap.add_argument("--out", default="paged_sweep.md")
    a = ap.parse_args()
    if a.split_sweep or a.pipeline_sweep:
        text = _table(split_sweep(print) if a.split_sweep else pipeline_sweep(print))
        Path(a.out).write_text(text + "\n")
        print(text)
        raise SystemExit(0)
    rows = sweep(print)
    text = "\n\n".join(_table([r for r in rows if r["case"].startswith(p)]) for p in ("chunk", "ragged", "decode"))
    Path(a.out).write_text(text + "\n")
    print(text)
