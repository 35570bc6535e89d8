"""Domain exceptions of the service. Transports map them to status codes in one place each:
HTTP by ``http_status``, gRPC by ``grpc_code`` (names of ``grpc.StatusCode``), per docs/api.md#errors.
"""

from __future__ import annotations


def size_text(n: float) -> str:
    """Bytes as an error message shows them: '48.8 KiB', '1.5 MiB', '2 GiB' (three digits; a small
    limit's sizes once read '0.00 MiB of 0.05 MiB')."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if abs(v) < 999.5 else f"{v:.0f} {unit}"
    return f"{n:.0f} bytes"


class ServiceError(Exception):
    """Base: ``message`` is what a person reads; ``code`` is a stable machine-readable name."""

    http_status = 500
    grpc_code = "INTERNAL"
    code = "internal"

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class BadRequest(ServiceError):
    """Malformed body, missing tensor, bad or unknown option."""

    http_status, grpc_code, code = 400, "INVALID_ARGUMENT", "bad_request"


class UnsupportedMediaType(ServiceError):
    http_status, grpc_code, code = 415, "INVALID_ARGUMENT", "unsupported_media_type"


class InvalidInput(ServiceError):
    """Shapes or dtypes inconsistent, head dim > 256, wrong hidden size."""

    http_status, grpc_code, code = 422, "INVALID_ARGUMENT", "invalid_input"


class NotFound(ServiceError):
    """Unknown layer, model or session (an ended or expired session too)."""

    http_status, grpc_code, code = 404, "NOT_FOUND", "not_found"


class PayloadTooLarge(ServiceError):
    """Body or tensor over the configured limit, or more memory than a worker may use."""

    http_status, grpc_code, code = 413, "RESOURCE_EXHAUSTED", "payload_too_large"


class QueueFull(ServiceError):
    """Backpressure: the bounded queue is full; retry after ``retry_after_s``."""

    http_status, grpc_code, code = 429, "RESOURCE_EXHAUSTED", "queue_full"


class Unavailable(ServiceError):
    """Not ready, draining, or the device ran out of memory."""

    http_status, grpc_code, code = 503, "UNAVAILABLE", "unavailable"


class DeadlineExceeded(ServiceError):
    http_status, grpc_code, code = 504, "DEADLINE_EXCEEDED", "deadline_exceeded"


class Cancelled(ServiceError):
    """The caller went away (an HTTP client hung up, a gRPC call was cancelled): nobody reads this."""

    http_status, grpc_code, code = 499, "CANCELLED", "client_disconnected"


class Conflict(ServiceError):
    """A create with an id that is taken (a session)."""

    http_status, grpc_code, code = 409, "ALREADY_EXISTS", "already_exists"


class InsufficientStorage(ServiceError):
    """No room for a session's new keys: the KV cache is full, or --max-sessions are held."""

    http_status, grpc_code, code = 507, "RESOURCE_EXHAUSTED", "insufficient_storage"


class Unsupported(ServiceError):
    """A feature of a protocol the service speaks that it does not implement (Triton's shared
    memory, statistics, repository, trace and logging extensions)."""

    http_status, grpc_code, code = 501, "UNIMPLEMENTED", "unsupported"


class Unauthenticated(ServiceError):
    http_status, grpc_code, code = 401, "UNAUTHENTICATED", "unauthenticated"


def from_kernel_error(exc: ValueError) -> ServiceError:
    """A ``kernels.AttentionInputError`` becomes a 422 with the kernel's own message."""
    return InvalidInput(str(exc))
