"""Collect the summaries of many ``loadtest.run`` calls into one table (and plots).

    python -m loadtest.report DIR [--out OUTDIR]
    python -m loadtest.report --from-csv results.csv --out OUTDIR   # re-plot a table
    python -m loadtest.report --memory soak_memory.csv --out OUTDIR # plot a soak's memory series

Reads DIR/**/*_summary.json (or, with --from-csv, a results.csv this module wrote, e.g. one copied
from a GPU host without its cells); writes OUTDIR/results.md (markdown table), OUTDIR/results.csv
and, when matplotlib is importable (the dev extra brings it; the service's image lacks it),
OUTDIR/<mix>_throughput.png and <mix>_p99.png (one line per transport and batching setting,
against users), and <tag>_memory.png for each ``--sample-memory`` series found
(DIR/**/*_memory.csv, or --memory): MiB against time. OUTDIR defaults to DIR. ``bash bench/gpu.sh
loadtest`` (and ``soak``) ends with this.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

COLUMNS = ["mix", "transport", "batching", "users", "processes", "requests", "failures", "rps", "p50_ms",
           "p95_ms", "p99_ms", "tflops", "q_tokens_per_s", "kv_tokens_per_s", "mean_batch", "window_s", "memory"]


def load(directory: Path) -> list[dict]:
    rows = []
    for path in sorted(directory.rglob("*_summary.json")):
        s = json.loads(path.read_text())
        c, r, b = s["config"], s["result"], s.get("batch_sizes") or {}
        memory = "; ".join(f"{m['metric']} {m['growth'] / 2**20:+.0f} MiB "
                           f"{'flat' if m['flat'] else 'GROWING'}" for m in s.get("memory") or [])
        rows.append({
            "mix": c["mix"], "transport": "+".join(c["user_classes"]),
            "batching": c.get("labels", {}).get("batching", ""), "users": c["users"],
            "processes": c["processes"], "requests": r.get("requests", 0), "failures": r.get("failures", 0),
            **{k: r.get(k, math.nan) for k in ("p50_ms", "p95_ms", "p99_ms", "tflops",
                                                "q_tokens_per_s", "kv_tokens_per_s")},
            "rps": r.get("ok_rps", r.get("rps", math.nan)),  # answered requests a second (not failures)
            "mean_batch": b.get("mean") if b.get("mean") is not None else math.nan,
            "window_s": r.get("duration_s", math.nan), "memory": memory,
            "tag": c["tag"],
        })
    rows.sort(key=lambda r: (r["mix"], r["transport"], r["batching"], r["users"], r["tag"]))
    return rows


def load_csv(path: Path) -> list[dict]:
    """Rows of a results.csv written by ``main``, numbers parsed back."""
    ints, text = {"users", "processes", "requests", "failures"}, {"mix", "transport", "batching", "memory", "tag"}
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append({k: (v if k in text else int(v) if k in ints else float(v) if v else math.nan)
                         for k, v in r.items()})
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def markdown(rows: list[dict]) -> str:
    head = ["mix", "transport", "batching", "users", "ok req/s", "p50 ms", "p95 ms", "p99 ms", "fail/req",
            "TFLOP/s", "q tok/s", "kv tok/s", "mean batch", "window s", "memory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mix"], r["transport"], r["batching"], r["users"], r["rps"], r["p50_ms"], r["p95_ms"],
                 r["p99_ms"], f"{r['failures']}/{r['requests']}", r["tflops"], r["q_tokens_per_s"],
                 r["kv_tokens_per_s"], r["mean_batch"], r.get("window_s", math.nan), r["memory"]]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for mix in sorted({r["mix"] for r in rows}):
        for key, ylabel in (("rps", "requests/s"), ("p99_ms", "p99 latency, ms")):
            fig, ax = plt.subplots(figsize=(6, 4))
            series: dict[str, list[tuple[int, float]]] = {}
            for r in rows:
                if r["mix"] == mix:
                    series.setdefault(f"{r['transport']} batching {r['batching'] or '?'}", []).append(
                        (r["users"], r[key]))
            for name, pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("users")
            ax.set_ylabel(ylabel)
            ax.set_title(f"attnserve, mix {mix}")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            path = out / f"{mix}_{'throughput' if key == 'rps' else 'p99'}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def memory_plot(path: Path, out: Path) -> Path | None:
    """A ``loadtest.run --sample-memory`` CSV (time_s, source, metric, value in bytes) as one line
    per series, MiB against seconds: ``out/<tag>_memory.png``. Totals (flat by nature) are left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series: dict[str, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if "total" in r["metric"]:
                continue
            source = f"server pid {r['source']}" if r["source"].isdigit() else r["source"]
            series.setdefault(f"{r['metric']} ({source})", []).append((float(r["time_s"]), float(r["value"]) / 2**20))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("MiB")
    ax.set_title(f"attnserve memory, {path.name.removesuffix('_memory.csv')}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    target = out / path.name.replace("_memory.csv", "_memory.png")
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path, nargs="?", help="where the runs' *_summary.json files are")
    ap.add_argument("--from-csv", type=Path, default=None, help="a results.csv to re-tabulate and re-plot")
    ap.add_argument("--memory", type=Path, action="append", default=[],
                    help="a *_memory.csv to plot (repeatable); alone, only the plots are made")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.directory is not None and a.from_csv is not None or not (a.directory or a.from_csv or a.memory):
        ap.error("give DIR or --from-csv (or only --memory)")
    out = a.out or a.directory or (a.from_csv or a.memory[0]).parent
    out.mkdir(parents=True, exist_ok=True)
    memory = [*a.memory, *(sorted(a.directory.rglob("*_memory.csv")) if a.directory else [])]
    plotted = [p for p in (memory_plot(m, out) for m in memory) if p is not None]
    if a.directory is None and a.from_csv is None:
        print("wrote " + ", ".join(map(str, plotted)))
        return
    rows = load(a.directory) if a.from_csv is None else load_csv(a.from_csv)
    (out / "results.md").write_text(markdown(rows))
    if a.from_csv is None or a.from_csv.resolve() != (out / "results.csv").resolve():
        with open(out / "results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*COLUMNS, "tag"])
            w.writeheader()
            w.writerows(rows)
    written = plots(rows, out) + plotted
    print(markdown(rows))
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}" + "".join(f", {p}" for p in written))


if __name__ == "__main__":
    main()
