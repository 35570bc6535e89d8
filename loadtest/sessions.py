"""Session mixes of the load tests (docs/api.md#sessions) and their client-side reference (no Locust here).

One user's task is a whole session's life, as a serving stack drives it: create, a prefill in
chunks, decode steps, the last one with ``end``. Every step sends fresh random q, k, v; the user
keeps each layer's keys and values (float32, as rounded to the dtype) and checks sampled rows of
every answer against numpy's attention over them, bottom-right causal. So a wrong answer, another
session's answer, a step appended twice or not at all, and keys out of order all fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadtest.payloads import DTYPE_CODES, WrongAnswer, _from_bits, _to_bits

# |o - reference| <= ATOL + RTOL * |reference|: the answer's rounding to the dtype, the kernel's
# P rounded to the input dtype before P·V (TF32 for float32 on a GPU), summation order.
ATOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-3}
RTOL = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-2}
ROWS_CHECKED = 2  # rows of a prefill chunk's answer checked (its last, and one at random)


@dataclass(frozen=True)
class SessionPlan:
    """One session's life: geometry, prefill length and chunk, decode steps."""

    label: str  # request names are "session <phase> <label>"
    layers: int
    hq: int
    hkv: int
    d: int
    dtype: str
    prefill: int
    chunk: int
    decode: int
    weight: float = 1.0

    @property
    def steps(self) -> list[int]:
        """Rows of each step: the prefill's chunks, then one per decode step."""
        chunks = [min(self.chunk, self.prefill - i) for i in range(0, self.prefill, self.chunk)]
        return chunks + [1] * self.decode


# Llama-3-8B heads (GQA 32/8, D 128), two layers per session; and a small one for CPU servers
SESSION_MIXES: dict[str, list[SessionPlan]] = {
    "sessions": [SessionPlan(f"llama-{n // 1024}k-{t}", 2, 32, 8, 128, dt, n, 512, 64)
                 for n in (1024, 4096) for t, dt in (("bf16", "bfloat16"), ("f16", "float16"))],
    "sessions-small": [SessionPlan("gqa-small-f32", 2, 4, 2, 32, "float32", 40, 16, 6),
                       SessionPlan("gqa-small-f16", 2, 4, 2, 32, "float16", 24, 24, 6)],
}


class SessionReference:
    """The keys and values one session holds, per layer, and the answers its steps must give."""

    def __init__(self, plan: SessionPlan, rng: np.random.Generator):
        self.plan, self.rng = plan, rng
        self.k = [np.zeros((0, plan.hkv, plan.d), np.float32) for _ in range(plan.layers)]
        self.v = [np.zeros((0, plan.hkv, plan.d), np.float32) for _ in range(plan.layers)]

    def tensors(self, n: int) -> dict[str, tuple[list[int], bytes, np.ndarray]]:
        """Fresh q (1, Hq, n, D), k, v (1, Hkv, n, D): name -> (shape, bytes, values as rounded)."""
        p = self.plan
        out = {}
        for name, h in (("q", p.hq), ("k", p.hkv), ("v", p.hkv)):
            bits = _to_bits(self.rng.standard_normal((1, h, n, p.d), dtype=np.float32), p.dtype)
            out[name] = ([1, h, n, p.d], bits.tobytes(), _from_bits(bits, p.dtype))
        return out

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v (1, Hkv, n, D) -> held (length + n, Hkv, D)."""
        self.k[layer] = np.concatenate([self.k[layer], k[0].transpose(1, 0, 2)])
        self.v[layer] = np.concatenate([self.v[layer], v[0].transpose(1, 0, 2)])

    def length(self, layer: int) -> int:
        return self.k[layer].shape[0]

    def check(self, layer: int, q: np.ndarray, o_raw: bytes | memoryview, shape: list[int], dtype: str,
              row_pick: int) -> None:
        """o (bytes of ``shape`` in ``dtype``) of a step of q (1, Hq, n, D) on ``layer`` after its
        append: sampled rows equal the attention over what the layer holds, query i of n seeing the
        keys j <= C - n + i."""
        p = self.plan
        n = q.shape[2]
        if list(shape) != [1, p.hq, n, p.d] or dtype != p.dtype:
            raise WrongAnswer(f"o is {list(shape)} {dtype}, expected {[1, p.hq, n, p.d]} {p.dtype}")
        item = DTYPE_CODES[p.dtype][3]
        if len(o_raw) != p.hq * n * p.d * item:
            raise WrongAnswer(f"o has {len(o_raw)} bytes, expected {p.hq * n * p.d * item}")
        bits = np.frombuffer(o_raw, dtype=np.float32 if item == 4 else np.uint16).reshape(p.hq, n, p.d)
        o = _from_bits(bits.copy(), p.dtype)
        k, v = self.k[layer], self.v[layer]
        c = k.shape[0]
        group = p.hq // p.hkv
        for i in sorted({n - 1, row_pick % n}):
            seen = c - n + i + 1
            kh = np.repeat(k[:seen].transpose(1, 0, 2), group, axis=0)  # (Hq, seen, D)
            vh = np.repeat(v[:seen].transpose(1, 0, 2), group, axis=0)
            s = np.einsum("hd,hjd->hj", q[0, :, i].astype(np.float64), kh) / math.sqrt(p.d)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            want = np.einsum("hj,hjd->hd", w / w.sum(axis=1, keepdims=True), vh)
            err = np.abs(o[:, i] - want)
            bound = ATOL[p.dtype] + RTOL[p.dtype] * np.abs(want)
            if not np.all(err <= bound):  # NaN fails too
                finite = np.isfinite(err)
                worst = float((err - bound)[finite].max()) if finite.any() else float("nan")
                raise WrongAnswer(f"layer {layer}, row {i} of {n} after {c} keys: o is off the reference "
                                  f"by {worst:.3g} past the bound ({int((~finite).sum())} non-finite values)")
