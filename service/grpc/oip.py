"""The Open Inference Protocol's gRPC framing: ``inference.GRPCInferenceService`` (docs/api.md#open-inference-protocol).

Framing only: tensors from ``raw_input_contents`` (one buffer per input; typed ``contents`` are
accepted for FP32/INT32/INT64 too) and into ``raw_output_contents``, parameters from their
``parameter_choice``. Models, parameters, outputs and messages are ``service.wire.oip``'s. Errors
are raised and get their status in ``server.ServiceInterceptor``, except on ModelStreamInfer,
which answers a failed request in-band with ``error_message`` (``errors.error_status``'s message),
as Triton does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import torch

from service.errors import BadRequest, NotFound
from service.grpc import forward
from service.grpc.codec import (
    check_answer_fits,
    deadline_of,
    declared_bytes,
    offload,
    result_bytes,
    run_concurrently,
    stream_window,
)
from service.grpc.errors import error_status
from service.grpc.protogen import inference_stubs
from service.wire import oip
from service.wire import tensors as wire

stubs = inference_stubs()
pb, pb_grpc = stubs.grpc_predict_v2_pb2, stubs.grpc_predict_v2_pb2_grpc
INFER_METHOD = f"/{pb.DESCRIPTOR.services_by_name['GRPCInferenceService'].full_name}/ModelInfer"

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH_METHODS = (f"/{SERVICE_NAME}/ServerLive", f"/{SERVICE_NAME}/ServerReady")
STREAM_WINDOW = 64  # requests one stream may have in flight; past it the server stops reading

_CONTENTS = {torch.float32: "fp32_contents", torch.int32: "int_contents", torch.int64: "int64_contents"}


def _parameters(params) -> dict[str, Any]:
    """name -> the value of whichever of bool_param/int64_param/double_param/string_param is set."""
    out = {}
    for name, p in params.items():
        which = p.WhichOneof("parameter_choice")
        if which:
            out[name] = getattr(p, which)
    return out


def _inputs(request, model: oip.Model) -> dict[str, torch.Tensor]:
    """name -> tensor, from raw_input_contents (one per input) or typed contents."""
    for inp in request.inputs:  # (an input in shared memory has no raw contents: said first)
        oip.check_tensor_parameters(f"input {inp.name!r}", inp.parameters)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} buffers for {len(request.inputs)} inputs; "
                         "send one per input, or none and typed contents")
    tensors: dict[str, torch.Tensor] = {}
    for i, inp in enumerate(request.inputs):
        name = oip.check_input_name(model, inp.name, tensors)
        if raw:
            if inp.HasField("contents"):  # which data counts would be a guess (Triton refuses it too)
                raise BadRequest(f"input {name!r} has both typed contents and raw_input_contents; send one")
            tensors[name] = oip.raw_tensor(name, inp.datatype, list(inp.shape), raw[i])
            continue
        dtype, shape = oip.input_dtype(name, inp.datatype), oip.input_shape(name, list(inp.shape))
        field = _CONTENTS.get(dtype)
        if field is None:
            raise BadRequest(f"input {name!r}: {inp.datatype} data must come in raw_input_contents")
        values = getattr(inp.contents, field)
        wire.check_shape(shape, f"input {inp.name!r}")  # no reshape to a shape torch cannot size
        numel = 1
        for d in shape:
            numel *= d
        if len(values) != numel:
            raise BadRequest(f"input {name!r}: {len(values)} values do not match shape {shape}")
        tensors[name] = torch.tensor(list(values), dtype=dtype).reshape(shape)
    return tensors


def _decode(request, model: oip.Model, deadline: float | None) -> oip.Call:
    for o in request.outputs:
        oip.check_tensor_parameters(f"output {o.name!r}", o.parameters)
    requested = [o.name for o in request.outputs]
    return oip.build_call(model, _inputs(request, model), _parameters(request.parameters), requested,
                          request_id=oip.call_id(request.id), deadline=deadline)


def _response(request, outputs: dict[str, torch.Tensor]):
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=oip.VERSION, id=request.id)
    for name, t in outputs.items():
        response.outputs.add(name=name, datatype=wire.OIP_NAMES[t.dtype], shape=list(t.shape))
        response.raw_output_contents.append(wire.tensor_to_bytes(t))
    return response


def _metadata(model: oip.Model):
    meta = model.metadata()
    T = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                    inputs=[T(**t) for t in meta["inputs"]],
                                    outputs=[T(**t) for t in meta["outputs"]])


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine):
        self.engine = engine

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.engine.ready)

    async def ModelReady(self, request, context):
        try:
            oip.find_model(self.engine, request.name, request.version)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.engine.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**oip.server_metadata(extensions=()))

    async def ModelMetadata(self, request, context):
        return _metadata(oip.find_model(self.engine, request.name, request.version))

    async def infer(self, request, deadline: float | None, inline: bool = False):
        """One ModelInferRequest -> ModelInferResponse (shared by ModelInfer and ModelStreamInfer);
        ``inline``: decoded on the event loop, so that it reaches the engine before any later call."""
        model = oip.find_model(self.engine, request.model_name, request.model_version)
        call = await offload(0 if inline else declared_bytes(request), _decode, request, model, deadline)
        check_answer_fits(call.request, self.engine.settings)
        outputs = await oip.infer(self.engine, call)
        return await offload(result_bytes(*outputs.values()), _response, request, outputs)

    def _owner(self, request, context) -> int | None:
        """Under --processes: the process that holds the session a sequence call steps (None: here)."""
        if "sequence_id" not in request.parameters:
            return None
        sid = oip.sequence_id(_parameters(request.parameters).get("sequence_id"))
        return None if sid is None else forward.grpc_owner(self.engine.settings, [sid], context)

    async def _forward(self, target: int, request, context):
        return await forward.forward_grpc(self.engine.settings, target, INFER_METHOD, request, context,
                                          pb.ModelInferResponse)

    async def ModelInfer(self, request, context):
        target = self._owner(request, context)
        if target is not None:
            return await self._forward(target, request, context)
        return await self.infer(request, deadline_of(context))

    async def ModelStreamInfer(self, request_iterator, context):
        deadline = deadline_of(context)
        in_order: dict[int, asyncio.Lock] = {}  # calls for another process: one at a time each, in order

        async def answer(request):
            target = self._owner(request, context)
            if target is None:  # a sequence's steps take effect in stream order: decoded inline
                return await self.infer(request, deadline, inline="sequence_id" in request.parameters)
            async with in_order.setdefault(target, asyncio.Lock()):
                return await self._forward(target, request, context)

        async def one(i: int, request):
            try:
                return pb.ModelStreamInferResponse(infer_response=await answer(request))
            except Exception as exc:  # answered in-band; the stream goes on
                return pb.ModelStreamInferResponse(
                    error_message=error_status(exc).message,
                    infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
                )

        window = stream_window(STREAM_WINDOW, self.engine.settings)
        async for response in run_concurrently(request_iterator, one, window):
            yield response


# Triton's rpcs of the extensions the server lacks: UNIMPLEMENTED saying which (grpc's own answer to
# a method it does not know is a bare "Method not found!")
TRITON_EXTENSIONS = {
    "ModelConfig": "model configuration (over gRPC)",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model repository", "RepositoryModelLoad": "model repository",
    "RepositoryModelUnload": "model repository",
    "SystemSharedMemoryStatus": "system shared memory", "SystemSharedMemoryRegister": "system shared memory",
    "SystemSharedMemoryUnregister": "system shared memory",
    "CudaSharedMemoryStatus": "CUDA shared memory", "CudaSharedMemoryRegister": "CUDA shared memory",
    "CudaSharedMemoryUnregister": "CUDA shared memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


class _Extensions(grpc.GenericRpcHandler):
    """Every other method of GRPCInferenceService: refused as ``oip.unsupported_extension``."""

    def service(self, details: grpc.HandlerCallDetails):
        service, _, method = details.method.lstrip("/").partition("/")
        if service != SERVICE_NAME:
            return None
        feature = TRITON_EXTENSIONS.get(method, f"{method!r} rpc")

        async def refuse(request, context):
            raise oip.unsupported_extension(feature)

        return grpc.unary_unary_rpc_method_handler(refuse)  # (the request is never parsed)


def add_to_server(engine, server) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(engine), server)
    server.add_generic_rpc_handlers((_Extensions(),))
