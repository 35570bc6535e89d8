"""The score modifiers flash-attn users rely on: a sliding window, a soft cap and ALiBi biases.

One checked ``Masks`` object carries them from the public entry points (``attention``,
``attention_varlen``, ``attention_paged``) to every backend. With ``i_al = i + n_k - n_q``, query
i's position aligned bottom-right (as causal is), the score of query i and key j is

    s_ij = softcap · tanh(scale · q_i·k_j / softcap)        (softcap > 0; else scale · q_i·k_j)
         - slope_h · |i_al - j|                             (alibi_slopes given)

and key j is visible iff ``i_al - left <= j <= i_al + right`` (a side of -1 is unbounded; causal
bounds the right side at 0), on top of causal and the key lengths. Rows that see no key give
o = 0 and lse = -inf. These are flash-attn's definitions (``flash_attn_func``'s docstring and
its ``attention_ref``: the scale first, then the cap, then the bias).
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

import torch

from .errors import AttentionInputError, DeviceMismatchError, DTypeError

UNBOUNDED = -1
WINDOW_FAR = 1 << 30  # a window side this long or longer is unbounded (docs/api.md)
LOG2E = 1.4426950408889634
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal
# the kernels scale scores into log2 units: a score past this (~2.36e38) is ±inf in them
BASE2_LIMIT = 3.4028234663852886e38 / LOG2E


class MaskError(AttentionInputError):
    """A window, soft cap or ALiBi slopes that break the contract (the message names which)."""


@dataclass(frozen=True, eq=False)
class Masks:
    """Checked score modifiers. left, right: window sides in keys (-1: unbounded); softcap: 0 is
    off; alibi: float32 (rows, Hq) slopes, rows = 1 (one set for every batch element or sequence)
    or B (S for the ragged entry points), or None."""

    left: int = UNBOUNDED
    right: int = UNBOUNDED
    softcap: float = 0.0
    alibi: torch.Tensor | None = None

    @property
    def window(self) -> bool:
        """Whether the window bounds either side."""
        return self.left >= 0 or self.right >= 0

    @property
    def active(self) -> bool:
        """Whether any modifier is on (False: the call is plain attention)."""
        return self.window or self.softcap > 0 or self.alibi is not None

    def describe(self) -> str:
        """The modifiers that are on, as a caller names them (for refusals and log lines)."""
        on = []
        if self.window:
            on.append(f"window_size=({self.left}, {self.right})")
        if self.softcap > 0:
            on.append("softcap")
        if self.alibi is not None:
            on.append("alibi_slopes")
        return ", ".join(on) or "none"

    def alibi_for(self, rows: int) -> torch.Tensor | None:
        """The slopes as (rows, Hq), a stride of 0 between rows for a shared set."""
        if self.alibi is None:
            return None
        return self.alibi.expand(rows, self.alibi.shape[1])

    def sliced(self, start: int, stop: int) -> Masks:
        """The same modifiers for rows start:stop of the batch (or sequences)."""
        if self.alibi is None or self.alibi.shape[0] == 1:
            return self
        return Masks(self.left, self.right, self.softcap, self.alibi[start:stop])

    def kernel_args(self) -> tuple[int, int, float]:
        """(window left, window right, softcap · log2 e) as the Triton kernels take them: an
        unbounded side becomes a bound no key reaches, the cap is in the kernels' log2 units."""
        far = WINDOW_FAR
        return (far if self.left < 0 else self.left, far if self.right < 0 else self.right,
                self.softcap * LOG2E)


NO_MASKS = Masks()


def real(x: object) -> float | None:
    """x as a float when it is a real number (numpy's scalars included, a bool not), else None; an int
    past float's range is inf."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    try:
        return float(x)
    except OverflowError:
        return math.copysign(math.inf, x)


def as_float32(x: float) -> float:
    """x rounded to float32, as the kernels receive it: inf past float32's range, 0 below its smallest."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # struct refuses what rounds to inf
        return math.copysign(math.inf, x)


def check_masks(window_size: object, softcap: object, alibi_slopes: object, *, rows: int, heads_q: int,
                device: torch.device, causal: bool, rows_name: str = "B") -> Masks:
    """Validate the options: window_size a pair of ints >= -1, softcap 0 or a finite number from
    float32's smallest normal up (off past float32's range in the kernels' log2 units, ~2.36e38),
    alibi_slopes float32 [Hq] or [rows, Hq] on q's device. With causal the window's right side is
    dropped (causal bounds it at 0 already)."""
    if isinstance(window_size, list):
        window_size = tuple(window_size)
    if (not isinstance(window_size, tuple) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise MaskError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)  # numpy's integers too
    if left < -1 or right < -1:
        raise MaskError(f"window_size sides must be >= -1 (-1: unbounded), got ({left}, {right})")
    # a side of 2**30 or more reaches past any sequence: unbounded, on every entry point (the ragged
    # kernels once took 2**63 - 1 into their int arithmetic and saw no key)
    left, right = (UNBOUNDED if w >= WINDOW_FAR else w for w in (left, right))
    if causal:
        right = UNBOUNDED
    cap = real(softcap)
    if cap is None or not math.isfinite(cap) or cap < 0:
        raise MaskError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    if 0 < cap < FLOAT32_TINY:  # 0 or subnormal in the kernels' float32: 0 / cap is NaN there
        raise MaskError(f"softcap must be 0 (off) or at least 1.2e-38 (float32's smallest normal), got {softcap!r}")
    if math.isinf(as_float32(cap * LOG2E)):
        # the kernels take the cap in log2 units: past float32's range there, a cap bends only scores
        # near float32's own limit, so it is off (docs/api.md), as the service makes a cap past FLT_MAX
        cap = 0.0
    alibi = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise MaskError(f"alibi_slopes must be a float32 tensor [Hq] or [{rows_name}, Hq], "
                            f"got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise DTypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if alibi_slopes.device != device:
            raise DeviceMismatchError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
        shape = list(alibi_slopes.shape)
        if shape == [heads_q]:
            alibi = alibi_slopes.reshape(1, heads_q)
        elif shape == [rows, heads_q]:
            alibi = alibi_slopes
        else:
            raise MaskError(f"alibi_slopes must have shape [{heads_q}] (Hq) or [{rows}, {heads_q}] "
                            f"({rows_name}, Hq), got {shape}")
        if alibi_slopes.device.type == "cpu" and not bool(torch.isfinite(alibi_slopes * LOG2E).all()):
            # checked on the host only: reading a GPU tensor would synchronise the device. The kernels
            # work in log2 units: slope · log2(e) must stay finite in float32 (inf · 0 on the diagonal is NaN)
            raise MaskError("alibi_slopes must be finite, |slope| <= 2.3e38 (float32's range over log2(e))")
        alibi = alibi.detach()  # the slopes get no gradient (docs/kernels.md), on every kernel alike
    return Masks(left, right, cap, alibi)


def dense_masks(masks: Masks, n_q: int, n_k: int) -> Masks:
    """``masks`` with a window side no row's keys reach dropped (left >= Nk - 1 or right >= Nq - 1
    bounds nothing), so that such a call takes the paths of plain attention."""
    left = UNBOUNDED if masks.left >= n_k - 1 else masks.left
    right = UNBOUNDED if masks.right >= n_q - 1 else masks.right
    if (left, right) == (masks.left, masks.right):
        return masks
    return Masks(left, right, masks.softcap, masks.alibi)


def visible(rows: torch.Tensor, cols: torch.Tensor, n_q: int, n_k: int, causal: bool,
            masks: Masks) -> torch.Tensor | None:
    """Bool (len(rows), len(cols)) of which key each query row sees by causal and the window, or
    None when every key is visible."""
    if not causal and not masks.window:
        return None
    i_al = rows[:, None] + (n_k - n_q)
    j = cols[None, :]
    mask = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
    if causal:
        mask &= j <= i_al
    if masks.left >= 0:
        mask &= j >= i_al - masks.left
    if masks.right >= 0:
        mask &= j <= i_al + masks.right
    return mask


def modify_scores(s: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, n_q: int, n_k: int,
                  masks: Masks) -> torch.Tensor:
    """Softcap, then the ALiBi bias, on scaled scores s (B|1, Hq, len(rows), len(cols)), in s's dtype."""
    if masks.softcap > 0:
        s = torch.tanh(s / masks.softcap) * masks.softcap
    if masks.alibi is not None:
        dist = (rows[:, None] + (n_k - n_q) - cols[None, :]).abs().to(s.dtype)   # |i_al - j|
        s = s - masks.alibi.to(s.dtype)[:, :, None, None] * dist
    return s


__all__ = ["BASE2_LIMIT", "NO_MASKS", "UNBOUNDED", "MaskError", "Masks", "as_float32", "check_masks", "dense_masks",
           "modify_scores",
           "real", "visible"]
