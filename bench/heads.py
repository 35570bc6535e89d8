"""bench.kernels' heads section (``python -m bench.kernels --section heads``): the forward at every
head dim class and in chunked prefill (few query rows against many keys, causal bottom-right),
``flash`` (auto) against ``flash`` without the Gluon kernel (``gluon=False``: ``attn_fwd_tma`` or
``attn_fwd``) and SDPA's cuDNN and FlashAttention-2 backends, written to ``heads.md``.

TFLOP/s count 4·D·B·Hq per visible (query, key) pair, counted exactly (``bench.masks.visible_pairs``),
so a chunked prefill's causal rows count the ~97% of keys they see, not half."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench.kernels import inputs, kernels_compiled_since, n_sets, out_of_time, timed
from bench.masks import visible_pairs
from bench.report import md_table
from kernels import hopper
from kernels import launch as launch_cache
from kernels.flash import flash_forward

# (dtype, B, Hq, Hkv, Nq, Nk, D, causal), in the order run (the budget cuts the last ones)
HEAD_SHAPES = [
    ("bfloat16", 1, 16, 16, 4096, 4096, 256, True), ("bfloat16", 1, 16, 16, 4096, 4096, 256, False),
    ("bfloat16", 4, 16, 16, 2048, 2048, 96, False), ("bfloat16", 4, 16, 16, 4096, 4096, 96, True),
    ("float16", 2, 24, 24, 3000, 3000, 80, True), ("bfloat16", 4, 16, 16, 4096, 4096, 80, False),
    ("bfloat16", 2, 16, 16, 4096, 4096, 192, False), ("bfloat16", 2, 16, 16, 4096, 4096, 192, True),
    ("bfloat16", 8, 32, 8, 256, 4096, 128, True), ("bfloat16", 4, 32, 8, 1024, 8192, 128, True),
    ("bfloat16", 4, 32, 32, 4096, 4096, 64, False), ("bfloat16", 4, 32, 32, 4096, 4096, 64, True),
]
PROVIDERS = ("flash", "flash_triton", "sdpa_cudnn", "sdpa_flash")
# rows of a head dim attn_fwd_ws can split (hopper.split_cols) also run flash with every such dim split
# (its products over the head dim alone) and with none (over the whole padded tile)
SPLIT_PROVIDER, PADDED_PROVIDER = "flash_split", "flash_padded"
SPLIT_DIMS = frozenset({80, 96, 144, 160, 192})
BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}


def _fn(provider: str, n_q: int, n_k: int):
    """provider(q, k, v, causal) -> o; SDPA's causal is top-left, so Nq != Nk passes its lower-right bias."""
    if provider in ("flash", "flash_triton"):
        gluon = provider == "flash"
        return lambda q, k, v, c: flash_forward(q, k, v, causal=c, scale=q.shape[-1] ** -0.5, gluon=gluon)[0]
    if provider in (SPLIT_PROVIDER, PADDED_PROVIDER):
        dims = SPLIT_DIMS if provider == SPLIT_PROVIDER else frozenset()

        def split(q, k, v, c):
            saved, hopper.GLUON_SPLIT_DIMS = hopper.GLUON_SPLIT_DIMS, dims
            try:
                return flash_forward(q, k, v, causal=c, scale=q.shape[-1] ** -0.5)[0]
            finally:
                hopper.GLUON_SPLIT_DIMS = saved
        return split

    def sdpa(q, k, v, c):
        group = q.shape[1] // k.shape[1]
        bias = causal_lower_right(n_q, n_k) if c and n_q != n_k else None
        with sdpa_kernel(BACKENDS[provider]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=c and bias is None,
                                                  enable_gqa=group > 1)
    return sdpa


def bench_heads(log, shapes=HEAD_SHAPES, rep=60) -> list[dict]:
    results = []
    for dt, b, hq, hkv, n_q, n_k, d, causal in shapes:
        row = {"dtype": dt, "shape": f"{b}x{hq}/{hkv}x{n_q}x{n_k}", "D": d, "causal": causal}
        if out_of_time():
            row["skipped"] = "time"
            results.append(row)
            continue
        dtype = getattr(torch, dt)
        nbytes = (b * hq * n_q + 2 * b * hkv * n_k) * d * dtype.itemsize
        sets = inputs(b, hq, hkv, n_q, n_k, d, dtype, sets=n_sets(nbytes))
        flops = 4.0 * d * b * hq * visible_pairs(n_q, n_k, causal)
        outs = {}
        for p in (*PROVIDERS, SPLIT_PROVIDER, PADDED_PROVIDER) if d in SPLIT_DIMS else PROVIDERS:
            try:
                before = set(launch_cache._compiled)
                ms, _, out = timed(_fn(p, n_q, n_k), sets, causal, rep=rep)
                if p.startswith("flash"):
                    row[p + "_kernel"] = kernels_compiled_since(before) or "(recipe)"
                row[p] = round(flops / ms / 1e9)
                outs[p] = out
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run says why
                row[p] = "err"
                log(f"  heads {p} {row['shape']}x{d} causal={causal}: {type(exc).__name__}: {str(exc)[:160]}")
            torch.cuda.empty_cache()
        ref = outs.get("sdpa_flash", outs.get("sdpa_cudnn"))
        if ref is not None and "flash" in outs:
            row["err"] = (outs["flash"].float() - ref.float()).abs().max().item()
        log("  heads " + ", ".join(f"{k}={v}" for k, v in row.items()))
        results.append(row)
        del sets, outs, ref
        torch.cuda.empty_cache()
    return results


HEAD_HEADERS = ["dtype", "B x Hq/Hkv x Nq x Nk", "D", "causal", "flash", "flash_triton", "sdpa_cudnn", "sdpa_flash",
                "flash / cuDNN", "flash / flash_triton", "err", "kernel (flash)", "flash_split", "flash_padded",
                "flash_split / cuDNN"]


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if isinstance(a, int) and isinstance(b, int) and b else "-"


def head_table_rows(rows) -> list[list]:
    out = []
    for r in rows:
        if "skipped" in r:
            out.append([r["dtype"], r["shape"], r["D"], r["causal"], "skipped (time)", *[""] * 10])
            continue
        out.append([r["dtype"], r["shape"], r["D"], r["causal"], *(r.get(p, "-") for p in PROVIDERS),
                    _ratio(r.get("flash"), r.get("sdpa_cudnn")), _ratio(r.get("flash"), r.get("flash_triton")),
                    f"{r['err']:.1e}" if "err" in r else "-", r.get("flash_kernel", "-"), r.get(SPLIT_PROVIDER, "-"),
                    r.get(PADDED_PROVIDER, "-"), _ratio(r.get(SPLIT_PROVIDER), r.get("sdpa_cudnn"))])
    return out


def write_heads_report(out_dir: Path, rows, meta, seconds: float) -> str:
    text = "\n".join([
        f"# Head dims and chunked prefill — {meta['date']}", "",
        f"Card: {meta['card']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}.",
        f"Command: `{meta['command']}`.", "",
        "Forward TFLOP/s, random normal inputs, do_bench medians; 4·D·B·Hq per visible (query, key) "
        "pair (causal is bottom-right, counted exactly). `flash_triton` is `flash_forward(gluon=False)`; "
        "`flash_split` and `flash_padded` (head dims `attn_fwd_ws` can split: 80, 96, 144, 160, 192) are `flash` "
        "with every such dim in `hopper.GLUON_SPLIT_DIMS` (products over the head dim alone) and with none "
        "(over the whole padded tile). "
        "`err` = max |flash − SDPA| (FA2 where it runs, else cuDNN).", "",
        md_table(HEAD_HEADERS, head_table_rows(rows)), "",
        f"Section time: {seconds:.0f} s.", ""])
    (out_dir / "heads.md").write_text(text)
    return text


# attn_fwd_ws's tile alternatives by tile D (``hopper.GLUON_TILES`` values: keys a block, O through the
# Q buffers, consumer registers), for ``python -m bench.heads --tiles``. A tile of 64 is not shipped
# (D 64 runs attn_fwd_tma and attn_fwd): the sweep lowers ``hopper.GLUON_MIN_D`` to time it.
TILE_CHOICES = {64: [(128, False, 232), (64, False, 232)],
                128: [(128, False, 232), (64, False, 232)],
                256: [(64, True, 240), (64, True, 232), (32, False, 240), (32, True, 240)]}
TILE_SHAPES = [("bfloat16", 1, 32, 32, 4096, 4096, 128, False), ("bfloat16", 1, 16, 16, 8192, 8192, 128, True),
               ("bfloat16", 1, 16, 16, 4096, 4096, 256, True), ("bfloat16", 1, 16, 16, 4096, 4096, 256, False),
               ("bfloat16", 2, 16, 16, 4096, 4096, 192, True), ("bfloat16", 4, 16, 16, 2048, 2048, 96, False),
               ("bfloat16", 4, 32, 32, 4096, 4096, 64, True), ("bfloat16", 4, 32, 32, 4096, 4096, 64, False)]


def sweep_tiles(log, shapes=TILE_SHAPES, rep=60) -> list[dict]:
    """Each of ``TILE_CHOICES`` in turn for the shapes' tile D, with and without its consumers taking
    turns (``hopper.GLUON_PINGPONG``), beside the shipped dispatch (``shipped``: for D 64 the Triton
    kernels) and cuDNN, TFLOP/s as ``bench_heads``'."""
    from kernels import hopper

    results = []
    kept, kept_min_d, kept_pingpong = dict(hopper.GLUON_TILES), hopper.GLUON_MIN_D, set(hopper.GLUON_PINGPONG)

    def restore() -> None:
        hopper.GLUON_TILES.clear()
        hopper.GLUON_TILES.update(kept)
        hopper.GLUON_MIN_D = kept_min_d
        hopper.GLUON_PINGPONG.clear()
        hopper.GLUON_PINGPONG.update(kept_pingpong)
        hopper._recipes.clear()

    try:
        for dt, b, hq, hkv, n_q, n_k, d, causal in shapes:
            dtype = getattr(torch, dt)
            sets = inputs(b, hq, hkv, n_q, n_k, d, dtype, sets=2)
            flops = 4.0 * d * b * hq * visible_pairs(n_q, n_k, causal)
            box = min(t for t in TILE_CHOICES if d <= t)
            row = {"shape": f"{dt} {b}x{hq}/{hkv}x{n_q}x{n_k}x{d}" + (" causal" if causal else "")}
            restore()
            ms, _, _ = timed(_fn("flash", n_q, n_k), sets, causal, rep=rep)
            row["shipped"] = round(flops / ms / 1e9)
            ms, _, _ = timed(_fn("sdpa_cudnn", n_q, n_k), sets, causal, rep=rep)
            row["sdpa_cudnn"] = round(flops / ms / 1e9)
            hopper.GLUON_MIN_D = min(kept_min_d, box)
            for tile in TILE_CHOICES[box]:
                for pingpong in (False, True):
                    hopper.GLUON_TILES[box] = tile
                    hopper.GLUON_PINGPONG.clear()
                    hopper.GLUON_PINGPONG.update({box} if pingpong else set())
                    hopper._recipes.clear()
                    ms, _, _ = timed(_fn("flash", n_q, n_k), sets, causal, rep=rep)
                    name = "{}/{}/r{}{}".format(tile[0], "O in Q" if tile[1] else "O apart", tile[2],
                                                " pingpong" if pingpong else "")
                    row[name] = round(flops / ms / 1e9)
            log("  tiles " + ", ".join(f"{k}={v}" for k, v in row.items()))
            results.append(row)
            del sets
            torch.cuda.empty_cache()
    finally:
        restore()
    return results


PINGPONG_SHAPES = [("bfloat16", 1, 16, 16, 4096, 4096, 256, False), ("bfloat16", 1, 16, 16, 4096, 4096, 256, True),
                   ("bfloat16", 1, 32, 32, 4096, 4096, 128, False), ("bfloat16", 1, 16, 16, 8192, 8192, 128, True),
                   ("bfloat16", 2, 16, 16, 4096, 4096, 192, False)]


def sweep_pingpong(log, shapes=PINGPONG_SHAPES, rounds=4, rep=60) -> list[dict]:
    """The shipped tile of each shape without and with ``hopper.GLUON_PINGPONG``, in ``rounds``
    alternating rounds (the order flips each round), TFLOP/s medians with their spread, and cuDNN:
    one pair timed once differs by as much as ping-pong moves a row."""
    import statistics

    from kernels import hopper

    kept = set(hopper.GLUON_PINGPONG)
    results = []
    try:
        for dt, b, hq, hkv, n_q, n_k, d, causal in shapes:
            sets = inputs(b, hq, hkv, n_q, n_k, d, getattr(torch, dt), sets=2)
            flops = 4.0 * d * b * hq * visible_pairs(n_q, n_k, causal)
            box = min(t for t in hopper.GLUON_TILES if d <= t)
            rates: dict[bool, list[float]] = {False: [], True: []}
            for r in range(rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    hopper.GLUON_PINGPONG.clear()
                    hopper.GLUON_PINGPONG.update({box} if on else set())
                    hopper._recipes.clear()
                    ms, _, _ = timed(_fn("flash", n_q, n_k), sets, causal, rep=rep)
                    rates[on].append(flops / ms / 1e9)
            ms, _, _ = timed(_fn("sdpa_cudnn", n_q, n_k), sets, causal, rep=rep)
            off, on = statistics.median(rates[False]), statistics.median(rates[True])
            row = {"shape": f"{dt} {b}x{hq}/{hkv}x{n_q}x{n_k}x{d}" + (" causal" if causal else ""),
                   "off": f"{off:.0f} ({min(rates[False]):.0f}-{max(rates[False]):.0f})",
                   "pingpong": f"{on:.0f} ({min(rates[True]):.0f}-{max(rates[True]):.0f})",
                   "pingpong / off": f"{on / off:.3f}", "sdpa_cudnn": round(flops / ms / 1e9)}
            log("  pingpong " + ", ".join(f"{k}={v}" for k, v in row.items()))
            results.append(row)
            del sets
            torch.cuda.empty_cache()
    finally:
        hopper.GLUON_PINGPONG.clear()
        hopper.GLUON_PINGPONG.update(kept)
        hopper._recipes.clear()
    return results


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="attn_fwd_ws's tile choices side by side (--tiles), or its "
                                 "ping-pong schedule off and on in alternating rounds (--pingpong)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--tiles", action="store_true")
    what.add_argument("--pingpong", action="store_true")
    ap.add_argument("--rounds", type=int, default=4, help="--pingpong: alternating rounds a shape")
    args = ap.parse_args()
    if args.pingpong:
        rows = sweep_pingpong(print, rounds=args.rounds)
        print(md_table(list(rows[0]), [list(r.values()) for r in rows]))
        return
    rows = sweep_tiles(print)
    for r in rows:
        print(md_table(list(r), [list(r.values())]))


if __name__ == "__main__":
    main()
