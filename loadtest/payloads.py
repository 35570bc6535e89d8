"""Request mixes, their data and the answer check of the load tests (no Locust in here); the wire
encodings that carry them are in loadtest/encodings.py.

The check costs one pass over the answer. Every request gets a fresh random vector ``c`` of length D
and sends ``v`` with every value row equal to ``c``. Whatever the attention weights are, each output
row ``O[i] = sum_j p_ij * c = c`` (the weights sum to one), so the answer must be ``c`` in every
row, up to the rounding of the output dtype and of the kernel's P·V product (P is rounded to the
input dtype before the MMA, TF32 for float32). ``c`` is new for every request, so somebody else's
answer, a stale buffer, zeros or NaN all fail, and the shape and dtype are checked as well.

q and k are random and built once per process (a few instances per shape); only v, which is just
``c`` repeated, is built per request (``bytes * n``: one memcpy).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np


class WrongAnswer(AssertionError):
    """The server answered, but not with what this request must give."""


# dtype name (native API) -> (safetensors code, OIP datatype, attention.v1 DType number, bytes)
DTYPE_CODES: dict[str, tuple[str, str, int, int]] = {
    "float16": ("F16", "FP16", 1, 2),
    "bfloat16": ("BF16", "BF16", 2, 2),
    "float32": ("F32", "FP32", 3, 4),
}
ST_TO_NAME = {v[0]: k for k, v in DTYPE_CODES.items()}
OIP_TO_NAME = {v[1]: k for k, v in DTYPE_CODES.items()}
PB_TO_NAME = {v[2]: k for k, v in DTYPE_CODES.items()}

# Relative tolerance of |o - c| / |c|: 8 units in the last place of fp16/bf16 (the P rounding and
# the output rounding use about 2); float32 inputs may run as TF32 (10-bit mantissa) on a GPU.
RTOL = {"float16": 2.0**-7, "bfloat16": 2.0**-4, "float32": 2.0**-8}
# Answers of more elements than this are checked on a strided subset of rows at a random phase
# (a prefill answer, 16M values: every 4th row), so that checking never limits the load; a mixed-up
# answer differs in every row, and over many requests every row is checked.
CHECK_LIMIT = 1 << 22


@dataclass(frozen=True)
class Shape:
    """One request shape. q: (b, hq, nq, d); k, v: (b, hkv, nk, d); layout bhnd."""

    label: str  # unique across every mix; request names are "<transport> <label>"
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: str
    causal: bool = False
    weight: float = 1.0  # relative frequency inside its mix

    @property
    def q_shape(self) -> list[int]:
        return [self.b, self.hq, self.nq, self.d]

    @property
    def kv_shape(self) -> list[int]:
        return [self.b, self.hkv, self.nk, self.d]

    @property
    def pairs(self) -> int:
        """(query, key) pairs computed per head: bottom-right causal keeps j <= i + nk - nq."""
        if not self.causal:
            return self.nq * self.nk
        return sum(max(0, min(self.nk, i + self.nk - self.nq + 1)) for i in range(self.nq))

    @property
    def flops(self) -> int:
        """Q·Kᵀ and P·V: 2 multiply-adds per pair per head dim each."""
        return 4 * self.b * self.hq * self.pairs * self.d

    @property
    def q_tokens(self) -> int:
        return self.b * self.nq

    @property
    def kv_tokens(self) -> int:
        return self.b * self.nk


SMALL = Shape("small-f16", 1, 12, 12, 128, 128, 64, "float16")  # BERT-base: 12 heads, D 64, N 128
PREFILL = [Shape(f"prefill-{t}", 1, 32, 32, 4096, 4096, 128, dt, causal=True)
           for t, dt in (("bf16", "bfloat16"), ("f16", "float16"))]
DECODE = [Shape(f"decode-{nk // 1024}k-{t}", 1, 32, 8, 1, nk, 128, dt)  # Llama-3-8B heads: GQA 32/8
          for nk in (8192, 16384, 32768) for t, dt in (("bf16", "bfloat16"), ("f16", "float16"))]
JSON_LIST = Shape("small-f32", 1, 12, 12, 128, 128, 64, "float32")  # JSON nested lists are float32

MIXES: dict[str, list[Shape]] = {
    "small": [SMALL],
    "prefill": PREFILL,
    "decode": DECODE,
    # mostly short requests, some long-context decode steps, a rare full prefill
    "mixed": [Shape(**{**SMALL.__dict__, "weight": 12.0}), *DECODE,
              *(Shape(**{**s.__dict__, "weight": 0.25}) for s in PREFILL)],
}
SHAPES: dict[str, Shape] = {s.label: s for mix in MIXES.values() for s in mix} | {JSON_LIST.label: JSON_LIST}


def label_of(name: str) -> str:
    """Request name "<transport> <label>" -> label."""
    return name.rsplit(" ", 1)[-1]


# ---------------------------------------------------------------- random data and the constant c


def _to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array -> the dtype's bit patterns (uint16 for fp16/bf16, uint32 for fp32)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    if dtype == "bfloat16":  # round to nearest even
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.view(np.uint32)


def _from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float32)


def random_tensor_bytes(rng: np.random.Generator, numel: int, dtype: str, block: int = 1 << 20) -> bytes:
    """Standard normal values; big tensors repeat one random block of ``block`` values (building
    a prefill's q and k then takes milliseconds, and the attention is as much work)."""
    raw = _to_bits(rng.standard_normal(min(numel, block), dtype=np.float32), dtype).tobytes()
    return (raw * -(-numel // block))[:numel * DTYPE_CODES[dtype][3]] if numel > block else raw


@dataclass
class Expected:
    """What the answer of one request must be: shape, dtype, and c (every row of o)."""

    shape: list[int]
    dtype: str
    c: np.ndarray  # float32 (d,), exactly representable in dtype

    def check_bits(self, raw: bytes | memoryview) -> None:
        """o as little-endian bytes of self.dtype: every row within RTOL of c (NaN never is)."""
        d = self.shape[-1]
        numel = int(np.prod(self.shape))
        item = DTYPE_CODES[self.dtype][3]
        if len(raw) != numel * item:
            raise WrongAnswer(f"o has {len(raw)} bytes, expected {numel * item} ({self.shape} {self.dtype})")
        rows = np.frombuffer(raw, dtype=np.float32 if item == 4 else np.uint16).reshape(-1, d)
        if rows.size > CHECK_LIMIT:  # big answers: a strided subset of rows, at a random phase
            step = -(-rows.size // CHECK_LIMIT)
            rows = rows[random.randrange(step)::step]
        rtol = RTOL[self.dtype]
        ends = np.stack([self.c * (1 - rtol), self.c * (1 + rtol)])
        bits = _to_bits(ends, self.dtype)
        if self.dtype == "float32":  # |c| >= 1/4 keeps both ends on c's side of zero
            ok = bool(np.all(np.abs(rows - self.c) <= rtol * np.abs(self.c)))
        else:
            # Same-sign floats are ordered as their sign-magnitude bit patterns, so the allowed
            # interval of each column is one interval of uint16: o - lo (wrapping) <= hi - lo.
            lo, hi = bits.min(axis=0), bits.max(axis=0)
            ok = bool(np.all(np.subtract(rows, lo, dtype=np.uint16) <= (hi - lo)))
        if not ok:
            raise WrongAnswer(self._describe(raw))

    def check_array(self, o: np.ndarray) -> None:
        """o already decoded to numbers (JSON lists): shape, then every row within RTOL of c."""
        if list(o.shape) != self.shape:
            raise WrongAnswer(f"o has shape {list(o.shape)}, expected {self.shape}")
        self.check_bits(_to_bits(np.ascontiguousarray(o, dtype=np.float32), self.dtype).tobytes())

    def check_header(self, shape: list[int], dtype: str) -> None:
        if list(shape) != self.shape or dtype != self.dtype:
            raise WrongAnswer(f"o is {list(shape)} {dtype}, expected {self.shape} {self.dtype}")

    def _describe(self, raw: bytes | memoryview) -> str:
        d = self.shape[-1]
        item = DTYPE_CODES[self.dtype][3]
        first = _from_bits(np.frombuffer(raw, dtype=np.uint16 if item == 2 else np.uint32)[:d].copy(),
                           self.dtype)
        err = np.abs(first - self.c) / np.abs(self.c)
        return (f"o is not this request's constant c (wrong or mixed-up answer): row 0 max rel err "
                f"{np.nanmax(err) if np.isfinite(err).any() else float('nan'):.3g} > {RTOL[self.dtype]:.3g}; "
                f"o[0,:4]={np.round(first[:4], 4).tolist()} c[:4]={np.round(self.c[:4], 4).tolist()}")


def random_c(rng: random.Random, d: int, dtype: str) -> tuple[np.ndarray, bytes]:
    """A fresh c: |c_j| in [1/4, 1), random signs, exact in dtype. Returns (c float32, c's bits)."""
    vals = np.array([rng.uniform(0.25, 1.0) * rng.choice((-1.0, 1.0)) for _ in range(d)], dtype=np.float32)
    bits = _to_bits(vals, dtype)
    return _from_bits(bits.copy(), dtype), bits.tobytes()


# ---------------------------------------------------------------- one prepared request per shape


@dataclass
class Prepared:
    """q and k of one shape, built once; ``make`` adds a fresh v and says what the answer must be."""

    shape: Shape
    q: bytes
    k: bytes
    cache: dict = field(default_factory=dict)  # per-encoding constant parts (headers, JSON text)

    def fresh_v(self, rng: random.Random) -> tuple[Expected, bytes]:
        s = self.shape
        c, c_bits = random_c(rng, s.d, s.dtype)
        return Expected(s.q_shape, s.dtype, c), c_bits * (s.b * s.hkv * s.nk)


def prepare(shape: Shape, seed: int) -> Prepared:
    rng = np.random.default_rng(seed)
    return Prepared(shape, random_tensor_bytes(rng, int(np.prod(shape.q_shape)), shape.dtype),
                    random_tensor_bytes(rng, int(np.prod(shape.kv_shape)), shape.dtype))


class Pool:
    """Prepared requests of one mix: ``instances`` random q/k sets per shape, drawn by weight."""

    def __init__(self, shapes: list[Shape], instances: int = 2, seed: int = 0):
        self.items: list[Prepared] = []
        self.weights: list[float] = []
        for s in shapes:
            n = instances if int(np.prod(s.kv_shape)) <= 1 << 20 else 1  # big k: one copy per process
            for i in range(n):
                self.items.append(prepare(s, seed * 1000 + len(self.items) + i))
                self.weights.append(s.weight / n)

    def draw(self, rng: random.Random) -> Prepared:
        return rng.choices(self.items, self.weights)[0]
