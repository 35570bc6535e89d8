"""What the benchmarks write besides text: markdown tables and a small PNG line plot made with
zlib alone (matplotlib is not on the GPU image)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path


def md_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def write_png(path: Path, series: dict[str, list[tuple[float, float]]], colors: dict[str, tuple]) -> None:
    """A minimal line plot written as PNG with zlib alone (matplotlib is not on the GPU image)."""
    w, h, pad = 640, 400, 30
    img = [[(255, 255, 255)] * w for _ in range(h)]
    xs = [x for pts in series.values() for x, _ in pts]
    if not xs:
        return
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y1 = 800.0

    def px(x, y):
        return (pad + int((x - x0) / (x1 - x0) * (w - 2 * pad)), h - pad - int(min(y, y1) / y1 * (h - 2 * pad)))

    for yy in range(0, 801, 100):  # grid every 100 TFLOP/s
        _, py = px(x0, yy)
        for xx in range(pad, w - pad):
            img[py][xx] = (220, 220, 220)
    for yy in range(pad, h - pad + 1):
        img[yy][pad] = (0, 0, 0)
    for xx in range(pad, w - pad):
        img[h - pad][xx] = (0, 0, 0)
    for name, pts in series.items():
        c = colors[name]
        pts = sorted(pts)
        for (xa, ya), (xb, yb) in zip(pts, pts[1:], strict=False):
            (pa, qa), (pb, qb) = px(xa, ya), px(xb, yb)
            steps = max(abs(pb - pa), abs(qb - qa), 1)
            for t in range(steps + 1):
                x_, y_ = pa + (pb - pa) * t // steps, qa + (qb - qa) * t // steps
                for dy in (-1, 0, 1):
                    if 0 <= y_ + dy < h:
                        img[y_ + dy][x_] = c
        for x, y in pts:
            cx, cy = px(x, y)
            for dx in range(-3, 4):
                for dy in range(-3, 4):
                    if 0 <= cy + dy < h and 0 <= cx + dx < w:
                        img[cy + dy][cx + dx] = c
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)
