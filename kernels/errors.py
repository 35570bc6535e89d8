"""Domain exceptions of the kernels API.

Every one is a ``ValueError`` whose message tells the caller what to change. The service maps
them to HTTP 422 / gRPC INVALID_ARGUMENT in one place per transport.
"""


class AttentionInputError(ValueError):
    """The inputs break the contract of ``attention()``."""


class ShapeError(AttentionInputError):
    """Ranks, batch sizes, lengths, head counts or head dims that do not fit together."""


class HeadDimError(ShapeError):
    """Head dim outside 1..256."""


class DTypeError(AttentionInputError):
    """A dtype other than float16/bfloat16/float32, or q, k, v of different dtypes."""


class DeviceMismatchError(AttentionInputError):
    """q, k, v (and kv_lengths) on different devices."""


class OptionError(AttentionInputError):
    """A scale that is not a number within float32's range, or a causal flag that is not a bool."""


class KVLengthsError(AttentionInputError):
    """kv_lengths of the wrong shape, dtype or range."""


class KernelUnavailableError(AttentionInputError):
    """The requested kernel cannot run on this device/shape; the message says why."""
