"""bench.kernels' masks section (``python -m bench.kernels --section masks``): sliding windows,
softcap, ALiBi and window + softcap through ``kernels.attention`` against the unmasked forward
(auto, the generic ``attn_fwd`` that ALiBi calls run, SDPA's cuDNN backend), TFLOP/s counted over
the visible score entries only, written to ``masks.md``."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bench.kernels import inputs, kernels_compiled_since, n_sets, out_of_time, sdpa_fn, timed
from bench.report import md_table
from kernels import attention
from kernels import launch as launch_cache
from kernels.flash import flash_forward

# masks section, in the order run (the budget cuts the last ones): (dtype, B, Hq, Hkv, N, D, modifiers);
# modifiers "all" = every row of mask_rows(), "window" = the unmasked and window rows alone (each new
# group, head dim or modifier set compiles and autotunes attn_fwd anew: seconds per set)
MASK_SHAPES = [
    ("bfloat16", 1, 32, 32, 8192, 128, "all"), ("float16", 1, 32, 32, 8192, 128, "all"),
    ("bfloat16", 1, 32, 32, 16384, 128, "all"), ("float16", 1, 32, 32, 16384, 128, "all"),
    ("bfloat16", 4, 32, 32, 8192, 128, "all"), ("float16", 4, 32, 32, 8192, 128, "all"),
    ("bfloat16", 4, 32, 32, 16384, 128, "all"), ("float16", 4, 32, 32, 16384, 128, "all"),
    ("bfloat16", 2, 32, 32, 8192, 128, "all"), ("float16", 2, 32, 32, 8192, 128, "all"),
    ("bfloat16", 2, 32, 32, 16384, 128, "all"), ("float16", 2, 32, 32, 16384, 128, "all"),
    ("bfloat16", 1, 32, 8, 16384, 128, "window"),   # GQA 32/8
    ("bfloat16", 4, 32, 32, 16384, 64, "window"),   # D 64
]
MASK_WINDOWS = (256, 1024, 4096)
MASK_SOFTCAP = 30.0


def mask_rows(windows=MASK_WINDOWS, which="all") -> list[tuple]:
    """(name, causal, window w or None, softcap, alibi): the modified rows of one shape. A window of
    w keys is (w - 1, 0) with causal (the key itself and w - 1 before it), (w/2, w/2) without;
    softcap, ALiBi and window + softcap (the middle window) run causal, as decoders use them.
    which "window": the window rows alone."""
    rows = [(f"window {w}", causal, w, 0.0, False) for causal in (True, False) for w in windows]
    if which == "all":
        mid = windows[len(windows) // 2]
        rows += [("softcap", True, None, MASK_SOFTCAP, False), ("alibi", True, None, 0.0, True),
                 (f"window {mid} + softcap", True, mid, MASK_SOFTCAP, False)]
    return rows


def window_sides(w: int | None, causal: bool) -> tuple[int, int]:
    """window_size for a window of w keys: (w - 1, 0) with causal, (w/2, w/2) without; (-1, -1): none."""
    if w is None:
        return (-1, -1)
    return (w - 1, 0) if causal else (w // 2, w // 2)


def visible_pairs(n_q: int, n_k: int, causal: bool, window: tuple[int, int] = (-1, -1)) -> int:
    """Exact count of the (query i, key j) pairs the kernels compute for causal and window_size,
    as kernels/masks.py defines them (bottom-right aligned: i_al = i + n_k - n_q)."""
    left, right = window
    total = 0
    for i in range(n_q):
        i_al = i + n_k - n_q
        hi = n_k - 1
        if causal:
            hi = min(hi, i_al)
        if right >= 0:
            hi = min(hi, i_al + right)
        lo = max(0, i_al - left) if left >= 0 else 0
        total += max(0, hi - lo + 1)
    return total


def alibi_slopes(n: int) -> list[float]:
    """The geometric ALiBi slopes of n heads (the ALiBi paper's, as flash-attn's tests and HF use):
    2^(-8/n)^(h+1), with the closest power of two's set interleaved for other n."""
    def pow2(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start ** (i + 1) for i in range(m)]

    if math.log2(n).is_integer():
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + alibi_slopes(2 * c)[0::2][: n - c]


def bench_masks(log, shapes=None, windows=MASK_WINDOWS, rep=60):
    """Score modifiers against unmasked attention, per shape: the unmasked causal and non-causal
    forward through ``kernels.attention`` ("auto": the Hopper kernels), through the generic Triton
    kernel ``attn_fwd`` that ALiBi calls run (``flash_forward(tma=False)``) and through
    SDPA's cuDNN backend; then each row of ``mask_rows`` through ``kernels.attention``. TFLOP/s count
    4·D·B·Hq per visible (i, j) pair (``visible_pairs``)."""
    results = []
    seen_kernel: dict[tuple, str] = {}  # what served a launch class, for rows that compiled nothing new
    for dt, b, hq, hkv, n, d, which in shapes or MASK_SHAPES:
        dtype = getattr(torch, dt)
        shape = {"dtype": dt, "B": b, "Hq": hq, "Hkv": hkv, "N": n, "D": d}
        todo = [("none", causal, None, 0.0, False) for causal in (False, True)] + mask_rows(windows, which)
        if out_of_time():
            results += [{**shape, "causal": r[1], "modifier": r[0], "skipped": "time"} for r in todo]
            continue
        nbytes = (b * hq * n * d + 2 * b * hkv * n * d) * dtype.itemsize
        sets = inputs(b, hq, hkv, n, n, d, dtype, sets=n_sets(nbytes))
        slopes = torch.tensor(alibi_slopes(hq), dtype=torch.float32, device=sets[0][0].device)
        plain: dict[tuple, float] = {}  # (provider, causal) -> TFLOP/s of the unmasked call
        for name, causal, w, cap, alibi in todo:
            row = {**shape, "causal": causal, "modifier": name}
            if out_of_time():
                row["skipped"] = "time"
                results.append(row)
                continue
            ws = window_sides(w, causal)
            pairs = visible_pairs(n, n, causal, ws)
            flops = 4.0 * d * b * hq * pairs
            row["visible"] = pairs / (n * n)
            if name == "none":
                providers = {
                    "auto": lambda q, k, v, c: attention(q, k, v, causal=c),
                    "attn_fwd": lambda q, k, v, c: flash_forward(q, k, v, causal=c, scale=q.shape[-1] ** -0.5,
                                                                 tma=False)[0],
                    "sdpa_cudnn": lambda q, k, v, c: sdpa_fn("sdpa_cudnn", q, k, v, c),
                }
            else:
                sl = slopes if alibi else None
                providers = {"auto": lambda q, k, v, c, ws=ws, cap=cap, sl=sl: attention(
                    q, k, v, causal=c, window_size=ws, softcap=cap, alibi_slopes=sl)}
            for p, fn in providers.items():
                try:
                    before = set(launch_cache._compiled)
                    ms, _, _ = timed(fn, sets, causal, rep=rep)
                    tf = flops / ms / 1e9
                    row[p + "_ms"], row[p] = ms, tf
                    if p != "sdpa_cudnn":
                        key = (dt, hq // hkv, n, d, causal, p if name == "none" else "masked", w is not None,
                               cap > 0, alibi)
                        seen_kernel[key] = kernels_compiled_since(before) or seen_kernel.get(key, "")
                        row[p + "_kernel"] = seen_kernel[key]
                    if name == "none":
                        plain[(p, causal)] = tf
                except Exception as exc:  # noqa: BLE001 - a provider that cannot run says why
                    row[p] = "err"
                    log(f"  masks {p} {dt} {b}x{hq}/{hkv}x{n}x{d} causal={causal} {name}: "
                        f"{type(exc).__name__}: {str(exc)[:160]}")
            if name != "none" and isinstance(row.get("auto"), float):
                for base in ("attn_fwd", "auto"):
                    if plain.get((base, causal)):
                        row["vs_" + base] = row["auto"] / plain[(base, causal)]
            log("  masks " + fmt_mask_row(row))
            results.append(row)
            torch.cuda.empty_cache()
        del sets
        torch.cuda.empty_cache()
    return results


def _num(x, fmt):
    return format(x, fmt) if isinstance(x, float) else (x if x is not None else "")


def fmt_mask_row(row) -> str:
    head = (f"{row['dtype']} {row['B']}x{row['Hq']}/{row['Hkv']}x{row['N']}x{row['D']} "
            f"causal={row['causal']} {row['modifier']}")
    if "skipped" in row:
        return head + " skipped"
    cols = [f"visible={row['visible']:.4f}"]
    for p in ("auto", "attn_fwd", "sdpa_cudnn"):
        if p in row:
            cols.append(f"{p}={_num(row.get(p + '_ms'), '.3f')}ms/{_num(row[p], '.0f')}TF")
    cols += [f"{k}={row[k]:.2f}" for k in ("vs_attn_fwd", "vs_auto") if k in row]
    cols += [f"{p}_kernel={row[p + '_kernel']}" for p in ("auto", "attn_fwd") if row.get(p + "_kernel")]
    return head + " " + " ".join(cols)


MASK_HEADERS = ["dtype", "B", "Hq/Hkv", "N", "D", "causal", "modifier", "visible %", "ms", "TFLOP/s",
                "vs attn_fwd", "vs auto", "attn_fwd ms", "attn_fwd TFLOP/s", "sdpa_cudnn TFLOP/s", "kernel (config)"]


def mask_table_rows(rows) -> list[list]:
    out = []
    for r in rows:
        head = [r["dtype"], r["B"], f"{r['Hq']}/{r['Hkv']}", r["N"], r["D"], r["causal"], r["modifier"]]
        if "skipped" in r:
            out.append(head + ["skipped"] * (len(MASK_HEADERS) - len(head)))
            continue
        kernel = r.get("auto_kernel", "")
        if r.get("attn_fwd_kernel"):
            kernel += f"; attn_fwd: {r['attn_fwd_kernel']}"
        out.append(head + [
            f"{100 * r['visible']:.2f}", _num(r.get("auto_ms"), ".3f"), _num(r.get("auto"), ".0f"),
            _num(r.get("vs_attn_fwd"), ".2f"), _num(r.get("vs_auto"), ".2f"), _num(r.get("attn_fwd_ms"), ".3f"),
            _num(r.get("attn_fwd"), ".0f"), _num(r.get("sdpa_cudnn"), ".0f"), kernel])
    return out


def write_masks_report(out_dir: Path, rows, meta, seconds: float) -> str:
    text = "\n".join([
        f"# Score modifiers — {meta['date']}", "",
        f"Card: {meta['card']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}.",
        f"Command: `{meta['command']}`.", "",
        "Forward, random normal inputs, do_bench medians. TFLOP/s = 4·D·B·Hq × the visible (i, j) pairs "
        "(`visible %` of Nq·Nk: causal and the window counted exactly), so a row that skips work "
        "well keeps the unmasked rate. `modifier` none: `ms`/`TFLOP/s` are `kernels.attention` "
        "(auto: the Hopper kernels), `attn_fwd` is `flash_forward(tma=False)`, the generic Triton "
        "kernel ALiBi calls run (windows and softcap run the Gluon prefill where it takes the shape). "
        "Modified rows run `kernels.attention(window_size=..., "
        f"softcap={MASK_SOFTCAP}, alibi_slopes=geometric)`; a window of w keys is (w − 1, 0) with "
        "causal, (w/2, w/2) without. `vs attn_fwd` / `vs auto`: the row's TFLOP/s over the unmasked "
        "attn_fwd / auto TFLOP/s of the same shape and causal flag (issue 31's target: ≥ 0.90 vs "
        "attn_fwd). The autotuner's key holds the modifier set but not w, B or Hq: the first row of "
        "a set tunes it for the others.", "",
        md_table(MASK_HEADERS, mask_table_rows(rows)), "",
        f"Section time: {seconds:.0f} s.", ""])
    (out_dir / "masks.md").write_text(text)
    return text
