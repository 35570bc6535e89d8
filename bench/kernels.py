"""Benchmark of the attention kernels on one GPU, every provider side by side in one run.

    python -m bench.kernels --out-dir reports/kernels [--budget-s 480] [--sections forward,decode] [--section paged]
    bash bench/gpu.sh kernels                # the kernels' GPU tests, then this, into reports/kernels/

Measures forward TFLOP/s on the anchor shapes and at long N, decode GB/s, and backward TFLOP/s.
Section ``masks`` (bench/masks.py; not in the default set; ``--section masks --budget-s 180``): the score modifiers
(sliding windows, softcap, ALiBi) against unmasked attention, TFLOP/s of the visible score entries
only, written to ``masks.md``. Section ``paged``: ragged and paged attention (bench/paged.py). Section
``heads`` (bench/heads.py; ``--section heads``): head dims 64 to 256 and chunked prefill against
cuDNN, written to ``heads.md``.
Providers: flash, flash_v1 (ours, Triton) and torch SDPA forced to each backend (flash, cuDNN,
efficient, math). TFLOP/s counts 4·B·Hq·Nq·Nk·D (half when causal; backward 2.5x the forward,
forward+backward 3.5x); decode reports GB/s of K and V read once. Times are
``triton.testing.do_bench`` medians (it flushes L2 before every call; small inputs are also rotated
among several copies). Extra memory = peak allocation during one call minus what was allocated
before it (the output included). Writes ``kernels.md`` and ``kernels_tflops.png`` to --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import sys
import time
from pathlib import Path

# this file is bench/kernels.py: keep its folder off sys.path so "kernels" is the package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.report import md_table, write_png  # noqa: E402
from bench.timing import graph_ms, rotated_ms  # noqa: E402
from kernels import hopper_bwd  # noqa: E402
from kernels import launch as launch_cache  # noqa: E402
from kernels.autograd import flash_attention_autograd  # noqa: E402
from kernels.flash import flash_forward  # noqa: E402
from kernels.flash_v1 import flash_v1_forward  # noqa: E402

SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_effic": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}
FWD_PROVIDERS = ["flash", "flash_v1", "sdpa_flash", "sdpa_cudnn", "sdpa_effic", "sdpa_math"]

# (dtype, B, H, N, D, causal): the anchor shapes, the rows of the forward table
ANCHORS = [
    ("float16", 1, 32, 1024, 128, False), ("float16", 1, 32, 1024, 128, True),
    ("float16", 1, 32, 4096, 128, False), ("float16", 1, 32, 4096, 128, True),
    ("float16", 1, 32, 16384, 128, False), ("float16", 1, 32, 16384, 128, True),
    ("float16", 4, 32, 1024, 64, False), ("float16", 4, 32, 4096, 64, False),
    ("float16", 4, 32, 4096, 64, True), ("float16", 4, 32, 16384, 64, False),
    ("float16", 16, 16, 512, 64, False), ("float16", 64, 12, 128, 64, False),
    ("float16", 64, 12, 128, 64, True), ("bfloat16", 1, 32, 4096, 128, False),
    ("bfloat16", 1, 32, 16384, 128, False), ("bfloat16", 4, 32, 4096, 64, False),
    ("bfloat16", 64, 12, 128, 64, False),
]
LONG = [("float16", 1, 8, 65536, 128, False), ("float16", 1, 8, 65536, 128, True),
        ("float16", 1, 8, 131072, 128, False), ("float16", 1, 8, 131072, 128, True)]
DECODE = [(1, 8192), (1, 32768), (1, 65536), (16, 8192), (16, 32768), (16, 65536)]  # (B, Nk)
BACKWARD = [(1, 32, 2048, 128, False), (1, 32, 4096, 128, False), (1, 32, 4096, 128, True),
            (1, 16, 8192, 128, True), (2, 32, 2048, 64, True), (4, 32, 4096, 64, False),
            (4, 32, 4096, 64, True), (2, 32, 1024, 128, False)]
# ours: what attention's backward runs by default (attn_bwd_ws where bwd_refusal lets it, with dQ's
# adds in order); the Triton kernels alone; attn_bwd_ws on every shape it can take, adds in order
# and unordered
_ANY_SIZE = dict(GLUON_BACKWARD=True, BWD_HEAD_DIMS=(64, 128), BWD_MIN_N=1)
BWD_OURS = {"flash": {}, "triton": dict(GLUON_BACKWARD=False), "gluon": dict(_ANY_SIZE, DETERMINISTIC=True),
            "gluon_nondet": dict(_ANY_SIZE, DETERMINISTIC=False)}

DEADLINE = [float("inf")]


def out_of_time() -> bool:
    return time.monotonic() > DEADLINE[0]


def sdpa_fn(name, q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPA[name]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)


def fwd_fn(name):
    if name == "flash":
        return lambda q, k, v, c: flash_forward(q, k, v, causal=c, scale=q.shape[-1] ** -0.5)[0]
    if name == "flash_v1":
        return lambda q, k, v, c: flash_v1_forward(q, k, v, causal=c, scale=q.shape[-1] ** -0.5)[0]
    return lambda q, k, v, c: sdpa_fn(name, q, k, v, c)


def inputs(b, hq, hkv, n_q, n_k, d, dtype, sets=1, requires_grad=False):
    out = []
    for _ in range(sets):
        q = torch.randn(b, hq, n_q, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
        k = torch.randn(b, hkv, n_k, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
        v = torch.randn(b, hkv, n_k, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
        out.append((q, k, v))
    return out


def n_sets(nbytes: int) -> int:
    return max(1, min(8, math.ceil(256e6 / max(nbytes, 1))))


def timed(fn, sets, causal, rep=60):
    """(median ms, extra MB, output of the first set); fn(q, k, v, causal)."""
    fn(*sets[0], causal)  # compile / autotune first: its buffers are not the kernel's
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*sets[0], causal)
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 1e6
    it = [0]

    def step():
        s = sets[it[0] % len(sets)]
        it[0] += 1
        fn(*s, causal)

    ms = do_bench(step, warmup=15, rep=rep, return_mode="median")
    return ms, extra, out


def kernels_compiled_since(before: set) -> str:
    """Which kernels (and autotuned configs) the launch cache gained since ``before``: what served
    the row, so a table can say which config answered (the cache is keyed per shape and dtype)."""
    names = []
    for key in set(launch_cache._compiled) - before:
        compiled, cfg, _ = launch_cache._compiled[key]
        name = compiled.metadata.name
        if cfg:
            name += f" {cfg.get('BLOCK_M')}/{cfg.get('BLOCK_N')}/w{cfg['num_warps']}/s{cfg['num_stages']}"
        names.append(name)
    return ", ".join(sorted(names))


def fwd_flops(b, hq, n_q, n_k, d, causal):
    f = 4.0 * b * hq * n_q * n_k * d
    return f / 2 if causal else f


def bench_forward(rows, providers, log):
    results = []
    for dt, b, h, n, d, causal in rows:
        dtype = getattr(torch, dt)
        row = {"dtype": dt, "B": b, "H": h, "N": n, "D": d, "causal": causal}
        if out_of_time():
            row["skipped"] = "time"
            results.append(row)
            continue
        nbytes = 3 * b * h * n * d * dtype.itemsize
        sets = inputs(b, h, h, n, n, d, dtype, sets=n_sets(nbytes))
        ref = None
        for p in providers:
            if p == "sdpa_math" and b * h * n * n * 4 * 3 > 60e9:
                row[p] = "OOM-risk"
                continue
            if p == "flash_v1" and (causal or n > 16384):
                row[p] = "-"
                continue
            if p == "sdpa_effic" and n > 16384:
                row[p] = "-"
                continue
            try:
                rep = 60 if n <= 16384 else 200
                before = set(launch_cache._compiled)
                ms, extra, out = timed(fwd_fn(p), sets, causal, rep=rep)
                if p == "flash":
                    row["flash_kernel"] = kernels_compiled_since(before)
                tf = fwd_flops(b, h, n, n, d, causal) / ms / 1e9
                row[p] = round(tf)
                row[p + "_mem"] = round(extra)
                if p == "sdpa_flash":
                    ref = out
                elif p in ("flash", "flash_v1") and ref is None:
                    row[p + "_out"] = out
                if ref is not None:
                    for mine in ("flash", "flash_v1"):
                        o = row.pop(mine + "_out", None)
                        if o is not None:
                            row[mine + "_err"] = (o.float() - ref.float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run says why
                row[p] = "err"
                log(f"  {p} {dt} {b}x{h}x{n}x{d} causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
            torch.cuda.empty_cache()
        for mine in ("flash", "flash_v1"):
            row.pop(mine + "_out", None)
        row["out_MB"] = round(b * h * n * d * dtype.itemsize / 1e6)
        log("  " + fmt_row(row, providers))
        results.append(row)
        del sets
        torch.cuda.empty_cache()
    return results


GRAPHED = ("flash", "sdpa_flash", "sdpa_cudnn")  # decode providers also timed from a CUDA graph


def bench_decode(log):
    results = []
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    for b, nk in DECODE:
        row = {"B": b, "Nk": nk}
        if out_of_time():
            row["skipped"] = "time"
            results.append(row)
            continue
        kv_bytes = 2 * b * hkv * nk * d * dtype.itemsize
        sets = inputs(b, hq, hkv, 1, nk, d, dtype, sets=n_sets(kv_bytes))
        # rotated_ms: distinct inputs, together at least five 60 MB L2s (300 MB)
        rot_sets = sets + inputs(b, hq, hkv, 1, nk, d, dtype, sets=max(0, math.ceil(300e6 / kv_bytes) + 1 - len(sets)))
        ref = None
        for p in ["flash", "sdpa_flash", "sdpa_cudnn", "sdpa_math"]:
            try:
                ms, extra, out = timed(fwd_fn(p), sets, False)
                row[p] = round(kv_bytes / ms / 1e6)
                if p in GRAPHED:  # device time alone: at B = 1 the host's launch work can exceed it
                    row[p + "_graph"] = round(kv_bytes / graph_ms(functools.partial(fwd_fn(p), *sets[0], False)) / 1e6)
                    calls = [functools.partial(fwd_fn(p), *s, False) for s in rot_sets]
                    row[p + "_rot"] = round(kv_bytes / rotated_ms(calls) / 1e6)
                if p == "flash":
                    mine = out
                if p == "sdpa_flash":
                    ref = out
            except Exception as exc:  # noqa: BLE001
                row[p] = "err"
                log(f"  decode {p} B={b} Nk={nk}: {type(exc).__name__}: {str(exc)[:160]}")
        if ref is not None and "flash" in row and row["flash"] != "err":
            row["flash_err"] = (mine.float() - ref.float()).abs().max().item()
        log(f"  decode B={b} Nk={nk}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
        results.append(row)
        del sets, rot_sets
        torch.cuda.empty_cache()
    return results


def time_backward(p, q, k, v, do, causal):
    """(grads, backward-alone ms, forward+backward ms) for provider p (``BWD_OURS`` sets
    ``kernels.hopper_bwd``'s switches for ours while it runs)."""
    if p in BWD_OURS:
        saved = {name: getattr(hopper_bwd, name) for name in BWD_OURS[p]}
        for name, value in BWD_OURS[p].items():
            setattr(hopper_bwd, name, value)
        try:
            return _time_backward(lambda: flash_attention_autograd(q, k, v, causal=causal,
                                                                   scale=q.shape[-1] ** -0.5)[0], q, k, v, do)
        finally:
            for name, value in saved.items():
                setattr(hopper_bwd, name, value)
    return _time_backward(lambda: sdpa_fn(p, q, k, v, causal), q, k, v, do)


def _time_backward(fwd, q, k, v, do):
    o = fwd()
    grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    ms_bwd = do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                      warmup=15, rep=60, return_mode="median")
    ms_all = do_bench(lambda: torch.autograd.grad(fwd(), (q, k, v), do), warmup=15, rep=60,
                      return_mode="median")
    return grads, ms_bwd, ms_all


def bench_backward(log):
    results = []
    dtype = torch.bfloat16
    for b, h, n, d, causal in BACKWARD:
        row = {"B": b, "H": h, "N": n, "D": d, "causal": causal}
        if out_of_time():
            row["skipped"] = "time"
            results.append(row)
            continue
        q, k, v = inputs(b, h, h, n, n, d, dtype, requires_grad=True)[0]
        do = torch.randn_like(q)
        f = fwd_flops(b, h, n, n, d, causal)
        grads = {}
        for p in [*BWD_OURS, "sdpa_flash", "sdpa_cudnn"]:
            try:
                grads[p], ms_bwd, ms_all = time_backward(p, q, k, v, do, causal)
                row[p + "_bwd"] = round(2.5 * f / ms_bwd / 1e9)
                row[p + "_fwdbwd"] = round(3.5 * f / ms_all / 1e9)
            except Exception as exc:  # noqa: BLE001
                row[p + "_bwd"] = row[p + "_fwdbwd"] = "err"
                log(f"  bwd {p} {b}x{h}x{n}x{d} causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
        if "flash" in grads and "sdpa_flash" in grads:
            row["flash_grad_rel_err"] = max(
                ((a.float() - r.float()).norm() / r.float().norm()).item()
                for a, r in zip(grads["flash"], grads["sdpa_flash"], strict=True))
        log("  bwd " + ", ".join(f"{k}={v}" for k, v in row.items()))
        results.append(row)
        grads.clear()
        torch.cuda.empty_cache()
    return results


def fmt_row(row, providers):
    head = f"{row['dtype']} {row['B']}x{row['H']}x{row['N']}x{row['D']} causal={row['causal']}"
    return head + " " + " ".join(f"{p}={row.get(p, '')}" for p in providers)


# ---------------------------------------------------------------- report


def write_report(out_dir: Path, fwd, long_rows, dec, bwd, meta, plot_ok):
    parts = [f"# Kernel benchmark — {meta['date']}", "",
             f"Card: {meta['card']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}.",
             f"Command: `{meta['command']}`.", "",
             "Forward TFLOP/s (4·B·H·N²·D, half when causal), do_bench median; `-`: not run for that shape "
             "(flash_v1 runs non-causal only; effic/math skipped at N > 16k); "
             "`OOM-risk`: the N×N matrices would not fit. err = max |flash − sdpa_flash|.", ""]
    hdr = ["dtype", "B", "H", "N", "D", "causal", *FWD_PROVIDERS, "flash/sdpa_flash", "flash err",
           "flash extra MB", "output MB", "flash kernel (config)"]
    rows = []
    for r in fwd + long_rows:
        if "skipped" in r:
            rows.append([r["dtype"], r["B"], r["H"], r["N"], r["D"], r["causal"], *["skipped"] * len(FWD_PROVIDERS),
                         "", "", "", "", ""])
            continue
        ratio = ""
        if isinstance(r.get("flash"), int) and isinstance(r.get("sdpa_flash"), int) and r["sdpa_flash"]:
            ratio = f"{r['flash'] / r['sdpa_flash']:.2f}"
        rows.append([r["dtype"], r["B"], r["H"], r["N"], r["D"], r["causal"],
                     *[r.get(p, "") for p in FWD_PROVIDERS], ratio,
                     f"{r['flash_err']:.1e}" if "flash_err" in r else "",
                     r.get("flash_mem", ""), r.get("out_MB", ""), r.get("flash_kernel", "")])
    parts += [md_table(hdr, rows), ""]
    parts += ["## Decode", "", "bf16, Nq = 1, Hq 32 / Hkv 8, D 128: GB/s of K and V read once "
              "(copy ceiling ~4,300 GB/s read + write). `_graph`: the same call replayed from a CUDA "
              "graph, the device's time alone (the others include any host time the GPU waited for). "
              "`_rot`: device time of calls on distinct inputs (together > 5 L2s) replayed back to "
              "back from one graph: cold inputs without the flush's dirty lines to write back first "
              "(bench/timing.py `rotated_ms`).", ""]
    dec_cols = ["flash", "sdpa_flash", "sdpa_cudnn", "sdpa_math"] + [p + "_graph" for p in GRAPHED] \
        + [p + "_rot" for p in GRAPHED]
    parts += [md_table(["B", "Nk", *dec_cols, "flash err"],
                       [[r["B"], r["Nk"], *[r.get(p, r.get("skipped", "")) for p in dec_cols],
                         f"{r['flash_err']:.1e}" if "flash_err" in r else ""] for r in dec]), ""]
    parts += ["## Backward", "", "bf16. bwd = backward alone (2.5x forward FLOPs); fwd+bwd = 3.5x. flash: "
              "the default (attn_bwd_ws where hopper_bwd.bwd_refusal lets it, else the Triton kernels); triton: "
              "the Triton kernels alone; gluon: attn_bwd_ws (Hopper) on every shape, dQ's adds in order; "
              "gluon_nondet: unordered. "
              "grad err = max over dq, dk, dv of ‖flash − sdpa_flash‖/‖sdpa_flash‖.", ""]
    bh = ["B", "H", "N", "D", "causal"]
    cols = [f"{p}_{w}" for w in ("bwd", "fwdbwd") for p in (*BWD_OURS, "sdpa_flash", "sdpa_cudnn")]
    parts += [md_table(bh + cols + ["grad err"],
                       [[r[c] for c in bh] + [r.get(c, r.get("skipped", "")) for c in cols] +
                        [f"{r['flash_grad_rel_err']:.1e}" if "flash_grad_rel_err" in r else ""]
                        for r in bwd]), ""]
    if plot_ok:
        parts += ["![TFLOP/s vs N](kernels_tflops.png)", "",
                  "Plot: fp16, D = 128, non-causal forward TFLOP/s vs N (x: log2 N, 1k..128k; y: 0..800). "
                  "Colours: flash red, flash_v1 orange, sdpa_flash blue, sdpa_cudnn green, "
                  "sdpa_effic purple, sdpa_math grey. H = 32 up to 16k, 8 at 64k/128k.", ""]
    (out_dir / "kernels.md").write_text("\n".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="reports/kernels")  # (docs/benchmarks holds the curated page)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new shapes after this")
    ap.add_argument("--sections", default="forward,long,decode,backward,heads",
                    help="comma-separated subset of forward, long, decode, backward, heads (bench/heads.py: "
                         "every head dim class and chunked prefill against cuDNN: heads.md), paged (bench/paged.py: "
                         "ragged and paged attention), masks (window, softcap and ALiBi against unmasked "
                         "attention, TFLOP/s of the visible work: masks.md)")
    ap.add_argument("--section", help="one section alone (e.g. --section paged): the same as --sections NAME")
    ap.add_argument("--causal", choices=("all", "only", "none"), default="all",
                    help="forward and long-N rows: all, only the causal ones, or only the non-causal ones")
    args = ap.parse_args()
    sections = {args.section} if args.section else set(args.sections.split(","))

    def rows_of(table):  # (dtype, B, H, N, D, causal) rows kept by --causal
        return [r for r in table if args.causal == "all" or r[-1] == (args.causal == "only")]

    DEADLINE[0] = time.monotonic() + args.budget_s
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_f = open(out_dir / "bench_log.txt", "w")  # noqa: SIM115

    def log(msg):
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    props = torch.cuda.get_device_properties(0)
    meta = {"date": datetime.date.today().isoformat(), "card": f"{props.name} ({props.multi_processor_count} SMs)",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "command": "PYTHONPATH=$PWD python3 " + " ".join(sys.argv)}
    log(f"{meta}")
    if "paged" in sections:
        from bench.paged import bench_paged

        bench_paged(out_dir, log, out_of_time, meta)
    if "masks" in sections:
        log("masks: window, softcap, ALiBi against unmasked attention")
        t0 = time.monotonic()
        from bench.masks import bench_masks, write_masks_report

        masks = bench_masks(log)
        log(write_masks_report(out_dir, masks, meta, time.monotonic() - t0))
    if "heads" in sections:
        log("heads: head dims and chunked prefill against cuDNN")
        t0 = time.monotonic()
        from bench.heads import bench_heads, write_heads_report

        heads = bench_heads(log)
        log(write_heads_report(out_dir, heads, meta, time.monotonic() - t0))
    if sections <= {"paged", "masks", "heads"}:
        return  # kernels.md holds the other sections: leave it as it is
    log("forward, anchor shapes")
    fwd = bench_forward(rows_of(ANCHORS), FWD_PROVIDERS, log) if "forward" in sections else []
    log("long N")
    long_rows = bench_forward(rows_of(LONG), ["flash", "sdpa_flash", "sdpa_cudnn"], log) if "long" in sections else []
    log("decode")
    dec = bench_decode(log) if "decode" in sections else []
    log("backward")
    bwd = bench_backward(log) if "backward" in sections else []
    colors = {"flash": (220, 30, 30), "flash_v1": (240, 150, 0), "sdpa_flash": (30, 80, 220),
              "sdpa_cudnn": (20, 160, 60), "sdpa_effic": (140, 50, 180), "sdpa_math": (120, 120, 120)}
    series: dict[str, list] = {p: [] for p in colors}
    for r in fwd + long_rows:
        if r.get("dtype") == "float16" and r.get("D") == 128 and not r.get("causal") and "skipped" not in r:
            for p in colors:
                if isinstance(r.get(p), int):
                    series[p].append((math.log2(r["N"]), r[p]))
    plot_ok = True
    try:
        write_png(out_dir / "kernels_tflops.png", {k: v for k, v in series.items() if v}, colors)
    except Exception as exc:  # noqa: BLE001
        plot_ok = False
        log(f"png failed: {exc}")
    write_report(out_dir, fwd, long_rows, dec, bwd, meta, plot_ok)
    log((out_dir / "kernels.md").read_text())


if __name__ == "__main__":
    main()
