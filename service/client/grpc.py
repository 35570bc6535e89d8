"""Python client of the gRPC API (attention.v1, docs/api.md#grpc), with the interface of the HTTP client
(``service.client.http.AttentionClient``): torch tensors in, torch tensors out.

    from service.client import GrpcAttentionClient
    with GrpcAttentionClient("localhost:8001", api_key=None, timeout=60.0) as client:
        o = client.attention(q, k, v, causal=True)                 # q: (B, Hq, Nq, D)
        o, lse = client.attention(q, k, v, return_lse=True)
        client.layers()                                            # [{"name", "family", ...}]
        y = client.call_layer("minilm0", x)                        # x: (B, N, hidden)
        client.ready()                                             # True once the server is warm
        for request_id, o in client.attention_stream({"q": q, "k": k, "v": v} for _ in range(100)):
            if isinstance(o, GrpcAttentionServiceError):           # this call failed; the others go on
                ...
            ...                                                    # completion order, ids "0", "1", ...
        with client.session(num_kv_heads=8, head_dim=128, dtype=torch.float16, layers=32) as s:
            o = s.step(q, k, v, layer=0)                           # sessions: service.client.sessions

Errors raise ``GrpcAttentionServiceError`` (an ``AttentionServiceError``): ``status`` is the
``grpc.StatusCode``, ``code`` the service's code (e.g. "invalid_input"), ``message`` its message.
On ``attention_stream`` a failed call is not raised but yielded in place of its result, the same
error type with the same fields, and the stream goes on.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.client.http import AttentionServiceError
from service.client.sessions import SessionsMixin, checked_affinity, q_lengths_tensor, session_ids
from service.errors import ServiceError
from service.grpc import codec as grpc_codec
from service.grpc.protogen import attention_stubs
from service.wire import SESSION_HEADER, tensors
from service.wire.options import PARSERS, parse_bool, parse_layer

_stubs = attention_stubs()
pb, pb_grpc = _stubs.attention_pb2, _stubs.attention_pb2_grpc

UNLIMITED = -1  # message size: the server's limit (--max-body-mb) is the one that applies
Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class GrpcAttentionServiceError(AttentionServiceError):
    """An error status: ``status`` (grpc.StatusCode), ``code`` (service code), ``message``."""


def _error(exc: grpc.RpcError) -> GrpcAttentionServiceError:
    trailers = dict(exc.trailing_metadata() or ())
    retry = trailers.get("retry-after")
    code = trailers.get("attnserve-error-code", exc.code().name.lower())
    return GrpcAttentionServiceError(exc.code(), code, exc.details() or "", float(retry) if retry else None)


@contextlib.contextmanager
def _building():
    """A request this client cannot even build (a tensor dtype the messages do not carry, a bad
    option) raises what the server would have answered: INVALID_ARGUMENT."""
    try:
        yield
    except ServiceError as exc:
        raise GrpcAttentionServiceError(grpc.StatusCode.INVALID_ARGUMENT, exc.code, exc.message, None) from None


def _call_error(err) -> GrpcAttentionServiceError:
    """An in-band attention.v1.CallError (AttendStream) -> the error a unary call would have raised."""
    status = getattr(grpc.StatusCode, err.status, grpc.StatusCode.UNKNOWN)
    retry = err.retry_after_s if err.HasField("retry_after_s") else None
    return GrpcAttentionServiceError(status, err.code or status.name.lower(), err.message, retry)


def _tensor(msg) -> torch.Tensor:
    """A response tensor, copied out of the message's bytes (so the caller may write to it)."""
    return tensors.tensor_from_bytes(bytearray(msg.data), list(msg.shape), grpc_codec.DTYPE_OF_ENUM[msg.dtype])


def attend_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   scale: float | None = None, kv_lengths: torch.Tensor | None = None,
                   return_lse: bool = False, layout: str = "bhnd", kernel: str = "auto",
                   request_id: str = "", window_size: Sequence[int] | None = None, softcap: float | None = None,
                   alibi_slopes: torch.Tensor | None = None):
    """The AttendRequest message of one call (the keyword arguments of ``attention``)."""
    o = _options(causal=causal, scale=scale, return_lse=return_lse, window_size=window_size, softcap=softcap)
    msg = pb.AttendRequest(causal=o["causal"], scale=o["scale"], layout=layout, return_lse=o["return_lse"],
                           kernel=kernel, request_id=request_id, **_masks(o["window_size"], o["softcap"]))
    return grpc_codec.with_tensors(msg, q=q, k=k, v=v, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes)


def _options(**raw: Any) -> dict[str, Any]:
    """Option values as the server reads them (``service.wire.options``; None stays unset): one of
    the wrong kind is refused here in the server's words (``_building``: INVALID_ARGUMENT), where
    the message's field would refuse it in protobuf's, or take "false" as true."""
    parsers = {**PARSERS, "layer": parse_layer, "end": parse_bool}
    return {name: None if value is None else parsers[name](name, value) for name, value in raw.items()}


def _masks(window_size: Sequence[int] | None, softcap: float | None) -> dict:
    """The score modifiers' scalar message fields (the slopes are a tensor); None leaves a field
    unset (the server's default)."""
    return {"window_size": None if window_size is None else list(window_size), "softcap": softcap}


def _result(resp) -> Result:
    o = _tensor(resp.o)
    return (o, _tensor(resp.lse)) if resp.HasField("lse") else o


class GrpcAttentionClient(SessionsMixin):
    """A synchronous client over one channel (HTTP/2 multiplexing); safe to share between threads.

    ``timeout`` (seconds) is each call's gRPC deadline; the server honours it (DEADLINE_EXCEEDED).
    """

    def __init__(self, target: str, api_key: str | None = None, timeout: float | None = 60.0,
                 options: Iterable[tuple[str, Any]] = (), session_affinity: str | None = None):
        """``session_affinity``: the x-attnserve-session metadata of every session call (default:
        the call's session id; service.client.sessions.SessionsMixin)."""
        self.timeout = timeout
        self.session_affinity = checked_affinity(session_affinity)
        api_key = api_key.strip() if api_key else api_key  # (as the server reads a key file's)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._closed = False
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", UNLIMITED),
            ("grpc.max_receive_message_length", UNLIMITED),
            *options,
        ])
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _check_open(self) -> None:
        if self._closed:
            raise GrpcAttentionServiceError(grpc.StatusCode.UNAVAILABLE, "unavailable",
                                            "this client is closed (close(), or its with block ended); make a "
                                            "new GrpcAttentionClient", None)

    def __enter__(self) -> GrpcAttentionClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, rpc, request, affinity: str | None = None):
        self._check_open()
        metadata = self._metadata if affinity is None else (*self._metadata, (SESSION_HEADER, affinity))
        try:
            return rpc(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  scale: float | None = None, kv_lengths: torch.Tensor | None = None,
                  return_lse: bool = False, layout: str = "bhnd", kernel: str = "auto",
                  window_size: Sequence[int] | None = None, softcap: float | None = None,
                  alibi_slopes: torch.Tensor | None = None) -> Result:
        """q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D) ((B, N, H, D) with layout="bnhd") -> o [, lse].
        window_size (left, right), softcap, alibi_slopes float32 (Hq,) or (B, Hq): flash-attn's score
        modifiers (docs/api.md#attention-semantics); None: the server's default (off)."""
        with _building():
            req = attend_request(q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths,
                                 return_lse=return_lse, layout=layout, kernel=kernel, window_size=window_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes)
        return _result(self._call(self._stub.Attend, req))

    def attention_stream(self, requests: Iterable[dict[str, Any]], timeout: float | None = None
                         ) -> Iterator[tuple[str, Result | GrpcAttentionServiceError]]:
        """Many calls on one AttendStream. Each item holds ``attention``'s keyword arguments (q, k, v,
        causal, ...) and optionally ``request_id`` (default: its position, "0", "1", ...).

        Yields one ``(request_id, outcome)`` per call, in completion order, where ``outcome`` is
        ``o``, ``(o, lse)`` (with ``return_lse``) or, for a call that failed, a
        ``GrpcAttentionServiceError`` (yielded, not raised: ``status``, ``code``, ``message``,
        ``retry_after_s``, as the same call on ``attention`` would raise). A failed call does not stop
        the others. Only a stream-level failure raises ``GrpcAttentionServiceError`` and ends the
        iteration: wrong API key, the stream's deadline (``timeout``, default the client's, bounds the
        whole stream), server unreachable or going away. A call this client cannot even build (a
        dtype the messages do not carry) is not sent: its outcome is that INVALID_ARGUMENT error."""
        return self._stream(self._stub.AttendStream, attend_request, requests, timeout)

    def _stream(self, rpc, build, requests: Iterable[dict[str, Any]], timeout: float | None
                ) -> Iterator[tuple[str, Result | GrpcAttentionServiceError]]:
        """``rpc`` (a stream-stream method) over ``build(**item)`` of each item, as ``attention_stream``."""
        self._check_open()
        refused: collections.deque = collections.deque()  # (request_id, error) of items not sent
        failed: list[BaseException] = []  # the caller's own iterator raised: raised here once the stream ends

        def messages():  # (grpc's thread)
            items = enumerate(requests)
            while True:
                try:
                    i, kwargs = next(items)
                except StopIteration:
                    return
                except Exception as exc:  # noqa: BLE001 - the caller's; the calls sent are still answered
                    failed.append(exc)
                    return
                kwargs = {"request_id": str(i), **kwargs}
                try:
                    with _building():
                        message = build(**kwargs)
                except GrpcAttentionServiceError as exc:
                    refused.append((kwargs["request_id"], exc))
                    continue
                except (TypeError, ValueError) as exc:  # a bad item (a misspelt option, a wrong type)
                    refused.append((kwargs["request_id"], GrpcAttentionServiceError(
                        grpc.StatusCode.INVALID_ARGUMENT, "bad_request", f"item {i} was not sent: {exc}", None)))
                    continue
                yield message

        try:
            for resp in rpc(messages(), timeout=timeout or self.timeout, metadata=self._metadata):
                while refused:
                    yield refused.popleft()
                yield resp.request_id, _call_error(resp.error) if resp.HasField("error") else _result(resp)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        while refused:
            yield refused.popleft()
        if failed:
            raise failed[0]

    def layers(self) -> list[dict[str, Any]]:
        """The loaded layers: name, family, hidden_size, num_heads, num_kv_heads, head_dim, dtype."""
        resp = self._call(self._stub.ListLayers, pb.ListLayersRequest())
        return [{"name": i.name, "family": i.family, "hidden_size": i.hidden_size, "num_heads": i.num_heads,
                 "num_kv_heads": i.num_kv_heads, "head_dim": i.head_dim,
                 "dtype": pb.DType.Name(i.dtype).lower()} for i in resp.layers]

    def call_layer(self, name: str, x: torch.Tensor, causal: bool = False,
                   positions: torch.Tensor | None = None,
                   kv_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, N, hidden) -> y: (B, N, hidden)."""
        with _building():
            req = grpc_codec.with_tensors(pb.LayerRequest(layer=name, causal=causal), x=x, positions=positions,
                                          kv_lengths=kv_lengths)
        return _tensor(self._call(self._stub.CallLayer, req).y)

    def ready(self) -> bool:
        """True when grpc.health.v1 says SERVING (the engine is warm and not draining)."""
        if self._closed:
            return False
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    # ---- sessions (docs/api.md#sessions; the shared logic: service.client.sessions) ----------------------

    def _create_session(self, fields: dict[str, Any], affinity: str | None) -> dict[str, Any]:
        # the message cannot say what the server would refuse: dtype and layers left unset mean
        # float16 and 1, so an unknown dtype or layers < 1 is refused here, as the server words it
        dtype, layers = grpc_codec.dtype_to_pb(fields["dtype"]), fields["layers"]
        if dtype == pb.DTYPE_UNSPECIFIED:
            raise GrpcAttentionServiceError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_input",
                                            f"dtype {fields['dtype']!r} is not supported; choose float16, bfloat16 or "
                                            "float32", None)
        if isinstance(layers, int) and not isinstance(layers, bool) and layers < 1:
            raise GrpcAttentionServiceError(grpc.StatusCode.INVALID_ARGUMENT, "invalid_input",
                                            f"layers must be at least 1, got {layers}", None)
        with _building():
            req = pb.CreateSessionRequest(session=fields["session"] or "", layers=layers,
                                          num_kv_heads=fields["num_kv_heads"], head_dim=fields["head_dim"],
                                          dtype=dtype)
        return _session_info(self._call(self._stub.CreateSession, req, affinity))

    def _session_step(self, sessions: list[str], tensors: dict[str, torch.Tensor | None], options: dict[str, Any],
                      affinity: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _building():
            req = session_attend_request(sessions, **tensors, **options)
        resp = self._call(self._stub.SessionAttend, req, affinity)
        return _tensor(resp.o), _tensor(resp.lse) if resp.HasField("lse") else None

    def session_stream(self, requests: Iterable[dict[str, Any]], timeout: float | None = None
                       ) -> Iterator[tuple[str, Result | GrpcAttentionServiceError]]:
        """Many steps on one SessionAttendStream, as ``attention_stream``: each item holds
        ``session_attend_request``'s keyword arguments (sessions, q, k, v, q_lengths, layer, causal,
        ...); steps on the same (session, layer) take effect in the order sent. Yields
        ``(request_id, o | (o, lse) | GrpcAttentionServiceError)`` in completion order."""
        return self._stream(self._stub.SessionAttendStream, session_attend_request, requests, timeout)

    def _get_session(self, session: str, affinity: str) -> dict[str, Any]:
        return _session_info(self._call(self._stub.GetSession, pb.GetSessionRequest(session=session), affinity))

    def _delete_session(self, session: str, affinity: str) -> None:
        self._call(self._stub.DeleteSession, pb.DeleteSessionRequest(session=session), affinity)


def session_attend_request(sessions: Any, q: torch.Tensor, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None, q_lengths: Any = None, layer: int = 0,
                           causal: bool = True, scale: float | None = None, return_lse: bool = False,
                           end: bool = False, layout: str = "bhnd", request_id: str = "",
                           window_size: Sequence[int] | None = None, softcap: float | None = None,
                           alibi_slopes: torch.Tensor | None = None):
    """The SessionAttendRequest message of one step (one session, 4-D q) or packed step (q_lengths)."""
    o = _options(layer=layer, causal=causal, scale=scale, return_lse=return_lse, end=end, window_size=window_size,
                 softcap=softcap)
    msg = pb.SessionAttendRequest(
        sessions=session_ids(sessions), layer=o["layer"],
        causal=o["causal"], scale=o["scale"], return_lse=o["return_lse"], end=o["end"], request_id=request_id,
        layout="" if q_lengths is not None else layout, **_masks(o["window_size"], o["softcap"]),
    )
    return grpc_codec.with_tensors(msg, q=q, k=k, v=v, alibi_slopes=alibi_slopes,
                                   q_lengths=None if q_lengths is None else q_lengths_tensor(q_lengths))


def _session_info(msg) -> dict[str, Any]:
    return {"session": msg.session, "layers": msg.layers, "num_kv_heads": msg.num_kv_heads,
            "head_dim": msg.head_dim, "dtype": pb.DType.Name(msg.dtype).lower(), "lengths": list(msg.lengths),
            "kv_bytes": msg.kv_bytes, "idle_s": msg.idle_s, "device": msg.device}
