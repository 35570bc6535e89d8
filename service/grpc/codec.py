"""Shared gRPC plumbing: attention.v1 messages <-> internal requests/results and torch tensors (both
directions, for ``server`` and ``service.client.grpc``), call deadlines, and concurrent calls on one stream
(``AttendStream``, ``ModelStreamInfer``). Wire conversion only: every check of shapes, dtypes and
options beyond decoding belongs to the engine and the kernels.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

from service.core.types import AttentionRequest, AttentionResult, LayerRequest, LayerResult
from service.errors import BadRequest, InvalidInput, PayloadTooLarge, size_text
from service.grpc.protogen import attention_stubs
from service.wire import tensors
from service.wire.options import parse_options, parse_scale
from service.wire.tensors import check_dims, kv_lengths_int32

if TYPE_CHECKING:
    from service.sessions import SessionResult

pb = attention_stubs().attention_pb2

# DType enum number <-> torch dtype (the enum's names are tensors.DTYPES' keys, upper-cased)
DTYPE_OF_ENUM: dict[int, torch.dtype] = {
    v.number: tensors.DTYPES[v.name.lower()] for v in pb.DType.DESCRIPTOR.values if v.number
}
ENUM_OF_DTYPE: dict[torch.dtype, int] = {d: n for n, d in DTYPE_OF_ENUM.items()}
ITEMSIZE_OF_ENUM: dict[int, int] = {n: d.itemsize for n, d in DTYPE_OF_ENUM.items()}


def tensor_from_pb(parent, field: str, *, required: bool = True) -> torch.Tensor | None:
    """``parent.<field>`` (an attention.v1.Tensor) -> a torch tensor sharing the message's bytes."""
    if not parent.HasField(field):
        if required:
            raise BadRequest(f"missing tensor {field!r}")
        return None
    msg = getattr(parent, field)
    if msg.dtype not in DTYPE_OF_ENUM:
        raise BadRequest(f"{field}: dtype {msg.dtype} is not set or unknown; use one of "
                         f"{', '.join(pb.DType.Name(n) for n in DTYPE_OF_ENUM)}")
    return tensors.tensor_from_bytes(msg.data, list(msg.shape), DTYPE_OF_ENUM[msg.dtype], name=field)


def tensor_to_pb(t: torch.Tensor):
    """A torch tensor -> attention.v1.Tensor (little-endian, row-major)."""
    return put_tensor(pb.Tensor(), t)


def put_tensor(field, t: torch.Tensor):
    """Write ``t`` into ``field``, an attention.v1.Tensor inside a message being built; returns it.
    Built in place because a message handed to a constructor is copied, bytes and all, and the
    copy makes serializing it several times slower too (protobuf's upb)."""
    if t.dtype not in ENUM_OF_DTYPE:
        raise InvalidInput(f"dtype {t.dtype} cannot travel as an attention.v1.Tensor; use one of "
                           f"{', '.join(str(d).removeprefix('torch.') for d in ENUM_OF_DTYPE)}")
    field.shape.extend(t.shape)
    field.dtype = ENUM_OF_DTYPE[t.dtype]
    field.data = tensors.tensor_to_bytes(t)
    return field


def with_tensors(msg, **fields: torch.Tensor | None):
    """``msg`` with each named attention.v1.Tensor field written from a torch tensor, in place
    (``put_tensor``); None leaves a field unset."""
    for name, t in fields.items():
        if t is not None:
            put_tensor(getattr(msg, name), t)
    return msg


def dtype_to_pb(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = tensors.DTYPES.get(dtype.removeprefix("torch."), dtype)
    return ENUM_OF_DTYPE.get(dtype, pb.DTYPE_UNSPECIFIED)


# ---- server side: request message -> internal request; internal result -> response message ----

def mask_options(msg) -> dict:
    """The score modifiers of an AttendRequest or SessionAttendRequest -> the request's keywords,
    parsed as the HTTP routes parse them (``service.wire.options``): window_size (empty: unbounded),
    softcap (unset: off), alibi_slopes (a Tensor)."""
    raw: dict = {}
    if len(msg.window_size):
        raw["window_size"] = list(msg.window_size)
    if msg.HasField("softcap"):
        raw["softcap"] = msg.softcap
    opts = parse_options(raw)
    slopes = tensor_from_pb(msg, "alibi_slopes", required=False)
    if slopes is not None:
        opts["alibi_slopes"] = slopes
    return opts


def scale_of(msg) -> float | None:
    """A message's optional scale, checked as the HTTP routes check it (unset: 1/sqrt(D))."""
    return parse_scale("scale", msg.scale) if msg.HasField("scale") else None


def attention_request(msg, *, deadline: float | None, request_id: str | None = None) -> AttentionRequest:
    """attention.v1.AttendRequest -> AttentionRequest (q/k/v views in bhnd); layout and kernel are
    parsed as the HTTP routes parse them (``service.wire.options``)."""
    q, k, v = (tensor_from_pb(msg, name) for name in ("q", "k", "v"))
    opts = parse_options({"layout": msg.layout or "bhnd", "kernel": msg.kernel or "auto"})
    check_dims({"q": q, "k": k, "v": v}, ("q", "k", "v"), 4, opts["layout"])
    ids = {"request_id": msg.request_id or request_id} if (msg.request_id or request_id) else {}
    return AttentionRequest.from_layout(
        q, k, v, causal=msg.causal, scale=scale_of(msg),
        return_lse=msg.return_lse, kv_lengths=kv_lengths_int32(tensor_from_pb(msg, "kv_lengths", required=False)),
        deadline=deadline, **opts, **mask_options(msg), **ids,
    )


def attend_response(res: AttentionResult | SessionResult):
    """An answer (o, lse, request_id: a call's or a session step's) -> attention.v1.AttendResponse."""
    return with_tensors(pb.AttendResponse(request_id=res.request_id), o=res.o, lse=res.lse)


def layer_request(msg, *, deadline: float | None) -> LayerRequest:
    """attention.v1.LayerRequest -> LayerRequest."""
    options = {"request_id": msg.request_id} if msg.request_id else {}
    return LayerRequest(
        layer=msg.layer, x=tensor_from_pb(msg, "x"), causal=msg.causal,
        positions=tensor_from_pb(msg, "positions", required=False),
        kv_lengths=kv_lengths_int32(tensor_from_pb(msg, "kv_lengths", required=False)), deadline=deadline,
        **options,
    )


def layer_response(res: LayerResult):
    return with_tensors(pb.LayerResponse(request_id=res.request_id), y=res.y)


def layer_info(info):
    return pb.LayerInfo(name=info.name, family=info.family, hidden_size=info.hidden_size,
                        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                        dtype=dtype_to_pb(info.dtype))


OFFLOAD_BYTES = 1 << 20  # convert messages bigger than this in a thread, off the event loop


@functools.cache
def _shaped_fields(descriptor) -> tuple[tuple[str, bool, bool], ...]:
    """(name, repeated, OIP) of a message type's fields whose messages have a ``shape``; OIP: its
    dtype is a ``datatype`` string, else an attention.v1 ``dtype`` enum."""
    return tuple((f.name, f.is_repeated, "datatype" in f.message_type.fields_by_name) for f in descriptor.fields
                 if f.message_type is not None and "shape" in f.message_type.fields_by_name)


OIP_ITEMSIZE = {"FP16": 2, "BF16": 2, "FP32": 4, "INT32": 4, "INT64": 8, "FP64": 8}


def declared_bytes(message) -> int:
    """The bytes a request's tensors declare: their shapes' products times their dtypes' sizes
    (4 where the dtype is unknown), over every message field with a ``shape`` (attention.v1 Tensor,
    OIP input). Whether to convert the request off the event loop; ``ByteSize()`` would serialize
    the whole message to count it."""
    total = 0
    for name, repeated, oip in _shaped_fields(message.DESCRIPTOR):
        value = getattr(message, name)
        for item in value if repeated else (value,):
            size = OIP_ITEMSIZE.get(item.datatype, 4) if oip else ITEMSIZE_OF_ENUM.get(item.dtype, 4)
            total += size * math.prod(item.shape)
    return total


async def offload(nbytes: int, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, in a thread when it converts more than OFFLOAD_BYTES (inline otherwise)."""
    if nbytes > OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's own ceiling for a message-size option
ANSWER_FRAMING_BYTES = 4096  # an answer's message around its tensors' bytes: shapes, dtypes, ids


def message_limit(settings: Any) -> int:
    """The largest message the server takes or sends (``--max-body-mb``)."""
    return min(settings.max_body_bytes, MAX_MESSAGE_BYTES)


def check_answer_fits(req: Any, settings: Any) -> None:
    """Refuse (RESOURCE_EXHAUSTED) an attention call or session step whose answer would pass the
    message limit, before it runs: gRPC refuses to send it only after the call ran, when a session
    step has appended its keys (and a stream would end instead of answering it in-band)."""
    q = getattr(req, "q", None)
    if q is None:  # a layer call: y is the size of x, which came in a message
        return
    rows = q.numel() // q.shape[-1]
    head_dim = req.v.shape[-1] if isinstance(req, AttentionRequest) else q.shape[-1]
    n = rows * head_dim * q.element_size() + (4 * rows if req.return_lse else 0)
    limit = message_limit(settings)
    if n + ANSWER_FRAMING_BYTES > limit:
        raise PayloadTooLarge(
            f"the answer would be {size_text(n)}, over the gRPC message limit of {size_text(limit)} "
            "(--max-body-mb); send fewer query rows a call, leave out return_lse, or raise --max-body-mb"
        )


def result_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


DEADLINE_MARGIN_S = 0.002  # a call's server-side deadline comes this much before the client's


def deadline_of(context) -> float | None:
    """The call's gRPC deadline as a ``time.monotonic()`` instant (None: the engine's default applies),
    ``DEADLINE_MARGIN_S`` early: the client's own timer ends the call at its deadline, so a step
    the server finished just inside a later clock (the request's transit, a forwarding hop) would
    read DEADLINE_EXCEEDED to the client while its keys were kept."""
    remaining = remaining_s(context)
    return None if remaining is None else time.monotonic() + remaining


def remaining_s(context) -> float | None:
    """The seconds left to the call, less ``DEADLINE_MARGIN_S`` (None: no deadline)."""
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)


# ---- concurrent calls on one stream -----------------------------------------------------------

_END = object()


def stream_window(window: int, settings: Any) -> int:
    """Calls one stream may have in flight: ``window``, or ``--max-queue-size`` where smaller (a
    stream alone must not fill the queue: its own calls would get queue_full)."""
    return max(1, min(window, settings.max_queue_size))


async def run_concurrently(requests: AsyncIterator, handle: Callable[[int, object], Awaitable[object]],
                           window: int) -> AsyncIterator:
    """Yield ``await handle(i, request)`` for each request of the stream, concurrently, in completion
    order. At most ``window`` calls are in flight or answered and not yet taken: a slot frees when
    the transport asks for the next answer, so a client that reads no answers stops the reading of
    its requests (and the answers it leaves do not pile up). ``handle`` answers a failed call itself (in-band,
    as AttendStream and ModelStreamInfer do); an exception it lets out ends the stream at once. An
    exception of ``requests`` (a message that does not parse) ends the stream after the calls
    already taken have been answered."""
    done: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(window)
    tasks: set[asyncio.Task] = set()

    async def one(i: int, request) -> None:
        try:
            done.put_nowait((await handle(i, request), None))
        except Exception as exc:
            done.put_nowait((None, exc))

    async def read() -> None:
        try:
            i = 0
            async for request in requests:
                await slots.acquire()
                task = asyncio.create_task(one(i, request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            while tasks:
                await asyncio.wait(set(tasks))
        except Exception as exc:
            while tasks:  # answer the calls already taken, then end the stream with exc
                await asyncio.wait(set(tasks))
            done.put_nowait((None, exc))
        done.put_nowait(_END)

    reader = asyncio.create_task(read())
    try:
        while (item := await done.get()) is not _END:
            result, exc = item
            if exc is not None:
                raise exc
            yield result
            slots.release()  # the transport took the answer (grpc.aio asks again once it is written)
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()
