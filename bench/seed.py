"""The seed's claims on this GPU: FlashAttention V1 against standard attention at 1k-8k tokens
(speed), and the HBM bytes each moves, read off the hardware counters by Nsight Compute, against
the seed's Θ(Nd + N²) for standard attention and Θ(N²d²/M) for FlashAttention.

    python -m bench.seed --out-dir $OUT            # speed, then HBM bytes under ncu (if it runs)
    python -m bench.seed --out-dir $OUT --no-ncu   # speed only

Providers, one (B, H, N, D) shape family, fp16, non-causal as in the seed:
  standard   S = QKᵀ·scale, P = softmax(S), O = PV in PyTorch: S and P written to and read from HBM
  flash_v1   ``kernels.attention(kernel="flash_v1")``: the seed's V1 order (K/V outer, Q inner,
             O/m/l round-tripped through HBM on every K/V block)
  flash      ``kernels.attention(kernel="flash")``: Q tiles outer, K/V streamed, O/m/l in registers

HBM bytes: ``ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum`` over one call (every
kernel it launches, caches flushed before each kernel: ncu's default ``--cache-control all``),
between ``cudaProfilerStart`` and ``cudaProfilerStop`` in a child process. Writes ``seed.md``,
``seed.csv`` and ``seed_hbm.png`` (matplotlib, when it imports) under --out-dir.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch

B, H, D, DTYPE = 8, 16, 64, torch.float16
NS = (1024, 2048, 4096, 8192)
PROVIDERS = ("standard", "flash_v1", "flash")
ELEM = 2  # bytes of an fp16 element
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}


def standard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The seed's standard attention: the N x N scores and probabilities go through HBM."""
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


def provider(name: str):
    if name == "standard":
        return standard
    from kernels import attention

    return lambda q, k, v: attention(q, k, v, kernel=name)


def inputs(n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, D, device="cuda", dtype=DTYPE, generator=g) for _ in range(3)]


def sram_elements() -> int:
    """M: the shared memory one block may take on this device, in fp16 elements."""
    props = torch.cuda.get_device_properties(0)
    per_block = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    return per_block // ELEM


def theory_bytes(n: int, m: int) -> dict[str, float]:
    """The seed's counts (elements x 2 bytes, x B·H): standard reads Q, K, writes S, reads S and
    writes P (softmax), reads P and V, writes O: 4N² + 4Nd. FlashAttention: N²d²/M (the seed's
    order, its constant left out), beside the exact count of the V2 order with 128-row Q tiles,
    2Nd + 2N²d/128 (Q read and O written once, K and V read once per Q tile)."""
    bh = B * H * ELEM
    return {"standard_theory": bh * (4 * n * n + 4 * n * D),
            "flash_seed_bound": bh * n * n * D * D / m,
            "flash_v2_tiles": bh * (2 * n * D + 2 * n * n * D / 128)}


def speed(log) -> list[dict]:
    from triton.testing import do_bench

    rows = []
    for n in NS:
        row: dict = {"N": n}
        for name in PROVIDERS:
            fn = provider(name)
            sets = [inputs(n, seed=i) for i in range(max(1, math.ceil(300e6 / (3 * B * H * n * D * ELEM))))]
            it = iter(range(1 << 30))

            def call(fn=fn, sets=sets, it=it):
                return fn(*sets[next(it) % len(sets)])

            try:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                call()
                torch.cuda.synchronize()
                row[f"{name}_extra_MB"] = round((torch.cuda.max_memory_allocated() - base) / 1e6)
                ms = do_bench(call, warmup=10, rep=60, return_mode="median")
                row[f"{name}_ms"] = round(ms, 4)
                row[f"{name}_tflops"] = round(4 * B * H * n * n * D / ms / 1e9)
            except torch.OutOfMemoryError:
                row[f"{name}_ms"] = "OOM"
            del sets
            torch.cuda.empty_cache()
        for name in ("flash_v1", "flash"):
            if isinstance(row.get(f"{name}_ms"), float) and isinstance(row.get("standard_ms"), float):
                row[f"{name}_speedup"] = round(row["standard_ms"] / row[f"{name}_ms"], 2)
        log(json.dumps(row))
        rows.append(row)
    return rows


def child(name: str, n: int) -> None:
    """One warm call, then one call between cudaProfilerStart/Stop (what ncu profiles)."""
    fn = provider(name)
    q, k, v = inputs(n)
    fn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_bytes(name: str, n: int, ncu: str) -> tuple[float, float, int] | str:
    """(bytes read, bytes written, kernels) of one call, or why ncu gave none."""
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
           "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum", "--csv",
           sys.executable, "-m", "bench.seed", "--child", name, str(n)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    got = parse_ncu_csv(r.stdout)
    if got is None:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        return "ncu: " + " / ".join(tail)[:300]
    return got


def parse_ncu_csv(text: str) -> tuple[float, float, int] | None:
    """(bytes read, bytes written, kernels) summed over ncu's ``--csv`` rows (one row per kernel
    and metric; ncu's own log lines, which start with ``==``, are skipped); None without rows."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return None
    read = write = 0.0
    kernels = set()
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        value = float(rec["Metric Value"].replace(",", "")) * UNITS.get(rec.get("Metric Unit", "byte"), 1)
        kernels.add(rec.get("ID"))
        if rec["Metric Name"] == "dram__bytes_read.sum":
            read += value
        elif rec["Metric Name"] == "dram__bytes_write.sum":
            write += value
    return read, write, len(kernels)


def hbm(log, m: int) -> tuple[list[dict], str | None]:
    ncu = shutil.which("ncu") or next((str(p) for p in Path("/opt/nvidia").glob("nsight-compute/*/ncu")), None)
    if ncu is None:
        return [], "ncu is not on this host"
    rows, why = [], None
    for n in NS:
        row: dict = {"N": n, **{k: round(v / 1e6, 1) for k, v in theory_bytes(n, m).items()}}
        for name in PROVIDERS:
            got = ncu_bytes(name, n, ncu)
            if isinstance(got, str):
                why = got
                row[f"{name}_MB"] = "-"
                continue
            row[f"{name}_MB"] = round((got[0] + got[1]) / 1e6, 1)
            row[f"{name}_kernels"] = got[2]
        log(json.dumps(row))
        rows.append(row)
        if why and all(row[f"{p}_MB"] == "-" for p in PROVIDERS):
            break  # the counters cannot be read here: no point in the longer rows
    return rows, why


def table(rows: list[dict], keys: list[str]) -> str:
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = [r["N"] for r in rows]
    for key, style, label in (("standard_theory", "--", "standard, 4N²+4Nd"),
                              ("flash_seed_bound", ":", "seed's bound N²d²/M"),
                              ("flash_v2_tiles", "-.", "flash, 2Nd+2N²d/128")):
        ax.plot(ns, [r[key] for r in rows], style, color="grey", label=label)
    for name, color in (("standard", "tab:blue"), ("flash_v1", "tab:orange"), ("flash", "tab:red")):
        pts = [(r["N"], r[f"{name}_MB"]) for r in rows if isinstance(r.get(f"{name}_MB"), float)]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=color, label=f"{name} (ncu)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("N (tokens)")
    ax.set_ylabel("HBM MB read + written, one call")
    ax.set_title(f"B={B} H={H} D={D} fp16, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="reports/seed")
    ap.add_argument("--no-ncu", action="store_true", help="speed only")
    ap.add_argument("--child", nargs=2, metavar=("PROVIDER", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    m = sram_elements()
    import triton

    meta = (f"{datetime.date.today()}, {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}; B={B} H={H} D={D} fp16, non-causal; M = {m} fp16 elements "
            f"({m * ELEM // 1024} KiB of shared memory a block); `python -m bench.seed {' '.join(sys.argv[1:])}`")
    print(meta, flush=True)
    fast = speed(print)
    hbm_rows, why = ([], "--no-ncu") if args.no_ncu else hbm(print, m)
    parts = ["# The seed's claims on this GPU", meta, "## Speed (ms, do_bench medians; speedup = standard / kernel)",
             table(fast, ["N", "standard_ms", "flash_v1_ms", "flash_ms", "flash_v1_speedup", "flash_speedup",
                          "standard_tflops", "flash_v1_tflops", "flash_tflops", "standard_extra_MB",
                          "flash_v1_extra_MB", "flash_extra_MB"])]
    if hbm_rows:
        parts += ["## HBM MB of one call (ncu: dram__bytes_read.sum + dram__bytes_write.sum)",
                  table(hbm_rows, ["N", "standard_MB", "standard_theory", "flash_v1_MB", "flash_MB",
                                   "flash_v2_tiles", "flash_seed_bound", "standard_kernels", "flash_v1_kernels",
                                   "flash_kernels"])]
        try:
            plot(out / "seed_hbm.png", hbm_rows)
        except Exception as exc:  # noqa: BLE001 - the table stands without the plot
            parts.append(f"(no plot: {type(exc).__name__}: {exc})")
    if why:
        parts.append(f"HBM counters: {why}")
    with open(out / "seed.csv", "w", newline="") as f:
        rows = [{"part": "speed", **r} for r in fast] + [{"part": "hbm", **r} for r in hbm_rows]
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    text = "\n\n".join(parts) + "\n"
    (out / "seed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
