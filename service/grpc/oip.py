"""Open Inference Protocol (KServe v2) over gRPC: ``inference.GRPCInferenceService`` (API.md §6).

Models: ``attention`` (inputs q, k, v FP16/BF16/FP32 [B, H, N, D], optional kv_lengths INT32 [B];
parameters causal, scale, return_lse; outputs o and, when asked, lse) and one model per loaded
layer (input x [B, N, hidden], optional positions INT64 [B, N] and kv_lengths; parameter causal;
output y). Tensors travel in raw_input_contents / raw_output_contents (typed ``contents`` are
accepted for FP32/INT32/INT64 too). Wire <-> internal conversion only; errors are raised as
``ServiceError`` and get their status code in ``grpc_server.ServiceInterceptor``, except on
ModelStreamInfer, which answers a failed request in-band with ``error_message`` as Triton does.
"""

from __future__ import annotations

import logging
from importlib import metadata

import torch

from service.core.types import AttentionRequest, LayerRequest
from service.errors import BadRequest, NotFound, ServiceError
from service.grpc.codec import deadline_of, offload, result_bytes, run_concurrently
from service.grpc.protogen import inference_stubs
from service.wire import tensors as wire

log = logging.getLogger("attnserve.oip")

stubs = inference_stubs()
pb, pb_grpc = stubs.grpc_predict_v2_pb2, stubs.grpc_predict_v2_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH_METHODS = (f"/{SERVICE_NAME}/ServerLive", f"/{SERVICE_NAME}/ServerReady")
ATTENTION_MODEL = "attention"
VERSION = "1"
ANY = -1  # a dimension of any size in model metadata
STREAM_WINDOW = 64  # requests one stream may have in flight; past it the server stops reading

try:
    SERVER_VERSION = metadata.version("attnserve")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare source tree
    SERVER_VERSION = "0.0.0"

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


# ---- parameters: bool_param / int64_param / double_param / string_param, each form accepted ----

def _param_value(params, name: str):
    if name not in params:
        return None
    p = params[name]
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def _bool_param(params, name: str, default: bool = False) -> bool:
    value = _param_value(params, name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise BadRequest(f"parameter {name!r} must be a boolean (bool_param or 'true'/'false'), got {value!r}")


def _float_param(params, name: str) -> float | None:
    value = _param_value(params, name)
    if value is None:
        return None
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise BadRequest(f"parameter {name!r} must be a number (double_param or a numeric string), got {value!r}")


# ---- tensors ----------------------------------------------------------------------------------

_CONTENTS = {torch.float32: "fp32_contents", torch.int32: "int_contents", torch.int64: "int64_contents"}


def _inputs(request) -> dict[str, torch.Tensor]:
    """name -> tensor, from raw_input_contents (one per input) or typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} buffers for {len(request.inputs)} inputs; "
                         "send one per input, or none and typed contents")
    tensors = {}
    for i, inp in enumerate(request.inputs):
        dtype = wire.dtype_from_name(inp.datatype, wire.OIP_DTYPES)
        shape = list(inp.shape)
        if raw:
            tensors[inp.name] = wire.tensor_from_bytes(raw[i], shape, dtype, name=inp.name)
            continue
        field = _CONTENTS.get(dtype)
        if field is None:
            raise BadRequest(f"input {inp.name!r}: {inp.datatype} data must come in raw_input_contents")
        values = getattr(inp.contents, field)
        wire.check_shape(shape, f"input {inp.name!r}")  # no reshape to a shape torch cannot size
        numel = 1
        for d in shape:
            numel *= d
        if len(values) != numel:
            raise BadRequest(f"input {inp.name!r}: {len(values)} values do not match shape {shape}")
        tensors[inp.name] = torch.tensor(list(values), dtype=dtype).reshape(shape)
    return tensors


def _take(tensors: dict, model: str, required: tuple[str, ...], optional: tuple[str, ...]) -> list:
    unknown = set(tensors) - set(required) - set(optional)
    if unknown:
        raise BadRequest(f"model {model!r} has no input {sorted(unknown)[0]!r}; "
                         f"its inputs are {', '.join(required + optional)}")
    for name in required:
        if name not in tensors:
            raise BadRequest(f"model {model!r}: missing input {name!r}")
    return [tensors.get(name) for name in required + optional]


def _response(request, outputs: dict[str, torch.Tensor]):
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
    for name, t in outputs.items():
        response.outputs.add(name=name, datatype=wire.OIP_NAMES[t.dtype], shape=list(t.shape))
        response.raw_output_contents.append(wire.tensor_to_bytes(t))
    return response


def _requested(request, available: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(o.name for o in request.outputs)
    for name in names:
        if name not in available:
            raise BadRequest(f"model {request.model_name!r} has no output {name!r}; "
                             f"its outputs are {', '.join(available)}")
    return names or default


# ---- the servicer -----------------------------------------------------------------------------

class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine):
        self.engine = engine

    def _layers(self) -> dict:
        return {info.name: info for info in self.engine.layer_infos()}

    def _check_model(self, name: str, version: str) -> None:
        if name != ATTENTION_MODEL and name not in self._layers():
            raise NotFound(f"unknown model {name!r}; the models are "
                           f"{', '.join([ATTENTION_MODEL, *self._layers()])}")
        if version not in ("", VERSION):
            raise NotFound(f"model {name!r} has no version {version!r}; the only one is {VERSION!r}")

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.engine.ready)

    async def ModelReady(self, request, context):
        try:
            self._check_model(request.name, request.version)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.engine.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="attnserve", version=SERVER_VERSION, extensions=[])

    async def ModelMetadata(self, request, context):
        self._check_model(request.name, request.version)
        meta = pb.ModelMetadataResponse(name=request.name, versions=[VERSION], platform="attnserve")
        T = pb.ModelMetadataResponse.TensorMetadata
        if request.name == ATTENTION_MODEL:  # q/k/v/o take FP16, BF16 or FP32 alike; FP16 is listed
            meta.inputs.extend([T(name=n, datatype="FP16", shape=[ANY] * 4) for n in ("q", "k", "v")])
            meta.inputs.append(T(name="kv_lengths", datatype="INT32", shape=[ANY]))
            meta.outputs.extend([T(name="o", datatype="FP16", shape=[ANY] * 4),
                                 T(name="lse", datatype="FP32", shape=[ANY] * 3)])
            return meta
        info = self._layers()[request.name]
        dtype = wire.OIP_NAMES.get(info.dtype, "FP32")
        meta.inputs.extend([T(name="x", datatype=dtype, shape=[ANY, ANY, info.hidden_size]),
                            T(name="positions", datatype="INT64", shape=[ANY, ANY]),
                            T(name="kv_lengths", datatype="INT32", shape=[ANY])])
        meta.outputs.append(T(name="y", datatype=dtype, shape=[ANY, ANY, info.hidden_size]))
        return meta

    async def infer(self, request, deadline: float | None):
        """One ModelInferRequest -> ModelInferResponse (shared by ModelInfer and ModelStreamInfer)."""
        self._check_model(request.model_name, request.model_version)
        tensors, params = await offload(request.ByteSize(), _inputs, request), request.parameters
        causal = _bool_param(params, "causal")
        if request.model_name == ATTENTION_MODEL:
            q, k, v, kv_lengths = _take(tensors, ATTENTION_MODEL, ("q", "k", "v"), ("kv_lengths",))
            default = ("o", "lse") if _bool_param(params, "return_lse") else ("o",)
            outputs = _requested(request, ("o", "lse"), default)
            req = AttentionRequest(q=q, k=k, v=v, causal=causal, scale=_float_param(params, "scale"),
                                   kv_lengths=kv_lengths, return_lse="lse" in outputs, deadline=deadline)
            res = await self.engine.attend(req)
            out = {name: res.o if name == "o" else res.lse for name in outputs}
            return await offload(result_bytes(*out.values()), _response, request, out)
        x, positions, kv_lengths = _take(tensors, request.model_name, ("x",), ("positions", "kv_lengths"))
        _requested(request, ("y",), ("y",))
        res = await self.engine.call_layer(LayerRequest(layer=request.model_name, x=x, causal=causal,
                                                        positions=positions, kv_lengths=kv_lengths,
                                                        deadline=deadline))
        return await offload(result_bytes(res.y), _response, request, {"y": res.y})

    async def ModelInfer(self, request, context):
        return await self.infer(request, deadline_of(context))

    async def ModelStreamInfer(self, request_iterator, context):
        deadline = deadline_of(context)

        async def one(i: int, request):
            try:
                return pb.ModelStreamInferResponse(infer_response=await self.infer(request, deadline))
            except ServiceError as exc:
                message = exc.message
            except Exception as exc:
                log.error("unexpected error in ModelStreamInfer", exc_info=exc)
                message = f"internal error ({type(exc).__name__}); see the server log"
            return pb.ModelStreamInferResponse(
                error_message=message,
                infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
            )

        async for response in run_concurrently(request_iterator, one, STREAM_WINDOW):
            yield response


def add_to_server(engine, server) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(engine), server)
