"""Devices and sizes: which devices ``--device`` names, the warm-up options, and the device memory
one launch of a request needs (what admission checks against a worker's budget)."""

from __future__ import annotations

import torch

from kernels.spec import MAX_HEAD_DIM
from service.core.types import AttentionRequest, LayerRequest
from service.wire.tensors import FLOAT_DTYPES


def resolve_devices(spec: str) -> list[torch.device]:
    """'auto' (every visible GPU, else the CPU), 'cpu', 'cuda' (every GPU) or 'cuda:0,cuda:1'."""
    spec = spec.strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    try:
        devices = [torch.device(part.strip()) for part in spec.split(",") if part.strip()]
    except RuntimeError:
        raise ValueError(
            f"--device {spec}: use 'auto', 'cpu', 'cuda' or a list such as 'cuda:0,cuda:1'"
        ) from None
    for d in devices:
        if d.type == "cuda":
            if not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count():
                raise ValueError(f"--device {spec}: {d} is not visible")
        elif d.type != "cpu":
            raise ValueError(f"--device {spec}: only 'cpu' and 'cuda[:N]' are supported, got {d}")
    if not devices:
        raise ValueError("--device is empty")
    return [torch.device("cuda", d.index or 0) if d.type == "cuda" else d for d in devices]


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'1x8x128x64,1x32x1024x128' -> [(B, H, N, D), ...]."""
    shapes = []
    for part in text.split(","):
        if part.strip():
            try:
                dims = tuple(int(x) for x in part.strip().lower().split("x"))
            except ValueError:
                dims = ()
            if len(dims) != 4 or min(dims) < 1:
                raise ValueError(f"warm-up shape {part.strip()!r} must be BxHxNxD, four positive integers")
            if dims[3] > MAX_HEAD_DIM:
                raise ValueError(f"warm-up shape {part.strip()!r}: head dim {dims[3]} is over {MAX_HEAD_DIM}, "
                                 "the largest the kernels serve")
            shapes.append(dims)
    return shapes


def parse_dtypes(text: str) -> list[torch.dtype]:
    """'float16,bfloat16' -> [torch.float16, torch.bfloat16]."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in FLOAT_DTYPES:
            raise ValueError(f"warm-up dtype {name!r} is not supported; choose from {', '.join(FLOAT_DTYPES)}")
    return [FLOAT_DTYPES[name] for name in names]


def attention_memory(req: AttentionRequest, device_type: str) -> int:
    """Bytes of device memory one launch of ``req`` needs (inputs, outputs, kernel workspace)."""
    b, hq, nq, d = req.q.shape
    hkv, nk = req.k.shape[1], req.k.shape[2]
    es = req.q.element_size()
    need = es * (2 * b * hq * nq * d + 2 * b * hkv * nk * d) + 4 * b * hq * nq + 8 * b
    if req.kernel == "reference":  # S-sized float32 temporaries, k/v expanded to Hq heads
        masks = req.spec.masks
        # a process's peak, with the server's allocator keeping freed blocks (service.allocator):
        # 5 S plain, 8-10 S with a cap, ALiBi or a mask (causal, window, kv_lengths; it varies with
        # how the freed blocks lie), and a margin
        masked = masks.active or req.causal or req.kv_lengths is not None
        scores = 12 if masked else 7
        need += 4 * (scores * b * hq * nq * nk + 2 * b * hq * nk * d + 2 * b * hq * nq * d)
    elif req.kernel == "flash_v1":  # float32 O/m/l partials, one per key slice (kernels/flash_v1.py)
        from kernels.flash_v1 import MAX_SPLITS

        need += 4 * MAX_SPLITS * b * hq * nq * (d + 2)
    elif device_type == "cpu":  # the blockwise CPU path: float32 accumulators + one score block
        need += 4 * (3 * b * hq * nq * d + 3 * min(b * hq * nq * nk, 1 << 24))
    return need


def layer_memory(req: LayerRequest, hidden: int) -> int:
    """Bytes a layer call needs: x, q/k/v/o projections and y, in float32 at worst."""
    b, n = req.x.shape[0], req.x.shape[1]
    return 4 * b * n * hidden * 8
