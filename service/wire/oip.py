"""The Open Inference Protocol (KServe v2, docs/api.md#open-inference-protocol) apart from its
framing, for both transports.

Each transport decodes its own framing (HTTP: JSON and the binary tensor data extension; gRPC:
protobuf with ``raw_input_contents``) into a model name, named input tensors, parameters (name ->
the Python value its wire gave: JSON bools/numbers/strings, or ``bool_param``/``int64_param``/
``double_param``/``string_param``) and the names of the outputs asked for. Everything else is here,
once: the server's and the models' metadata, which inputs and parameters a model takes, the
internal request built from them, the choice of attention or layer, which outputs are sent, and
every message of a refused call.

Models: ``attention`` (inputs q, k, v FP16/BF16/FP32 [B, H, N, D], optional kv_lengths INT32 [B]
and alibi_slopes FP32 [Hq] or [B, Hq]; parameters causal, scale, return_lse, kernel, window_size
("L,R"), softcap; outputs o and, when asked, lse) and one model per
loaded layer (input x [B, N, hidden], optional positions INT64 [B, N] and kv_lengths; parameter
causal; output y). Unknown parameters are ignored, as in the protocol; an unknown input or output
is refused, as Triton refuses one.

Sequences (docs/api.md#sessions): an ``attention`` call with Triton's sequence parameters (``sequence_id``, an
integer or a string, 0 or "" meaning none; ``sequence_start``; ``sequence_end``) is a session step
on the session ``str(sequence_id)``: ``sequence_start`` creates it from the step's own shapes (k and
v required; parameter ``layers``, default 1), parameter ``layer`` picks the layer (default 0),
``sequence_end`` releases it after the step, and ``causal`` defaults to true.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service import __version__
from service.core.types import AttentionRequest, LayerRequest, new_request_id
from service.errors import BadRequest, NotFound, Unsupported
from service.sessions import SessionStep
from service.wire.options import int_text, parse_bool, parse_options
from service.wire.tensors import (
    OIP_DTYPES,
    OIP_NAMES,
    aligned,
    check_dims,
    check_shape,
    dtype_from_name,
    kv_lengths_int32,
    tensor_from_bytes,
)

SERVER_NAME = "attnserve"
ATTENTION = "attention"
VERSION = "1"  # every model has this one version
ANY = -1  # a dimension of any size
MAX_ID = 128  # characters of a request's "id" kept (as X-Request-Id: it reaches logs and messages)
NOT_READY = "not ready: warming up or draining"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class Model:
    """One model's interface: its metadata, and what ``build_call`` accepts for it."""

    name: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: Mapping[str, str]  # name -> its type, as metadata shows it

    @property
    def is_attention(self) -> bool:
        return self.name == ATTENTION

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def metadata(self) -> dict[str, Any]:
        """``GET /v2/models/{m}`` / ModelMetadata (gRPC has no ``parameters`` field: it drops them)."""

        def tensors(specs: tuple[TensorSpec, ...]) -> list[dict]:
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in specs]

        return {"name": self.name, "versions": [VERSION], "platform": self.platform,
                "inputs": tensors(self.inputs), "outputs": tensors(self.outputs),
                "parameters": dict(self.parameters)}  # fmt: skip

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (``GET /v2/models/{m}/config``, read by perf_analyzer)."""

        def tensors(specs: tuple[TensorSpec, ...], inputs: bool) -> list[dict]:
            # ("optional" is a field of Triton's ModelInput only: an output is sent when asked for)
            return [{"name": t.name, "data_type": "TYPE_" + t.datatype, "dims": list(t.shape),
                     **({"optional": t.optional} if inputs else {})} for t in specs]  # fmt: skip

        return {"name": self.name, "platform": self.platform, "max_batch_size": 0,
                "input": tensors(self.inputs, True), "output": tensors(self.outputs, False)}  # fmt: skip


# q/k/v/o take FP16, BF16 or FP32 alike (o follows q); metadata lists FP16
ATTENTION_MODEL = Model(
    name=ATTENTION,
    platform=SERVER_NAME,
    inputs=(
        *(TensorSpec(n, "FP16", (ANY,) * 4) for n in ("q", "k", "v")),
        TensorSpec("kv_lengths", "INT32", (ANY,), optional=True),
        TensorSpec("alibi_slopes", "FP32", (ANY, ANY), optional=True),  # [Hq] or [B, Hq]
    ),
    outputs=(TensorSpec("o", "FP16", (ANY,) * 4), TensorSpec("lse", "FP32", (ANY,) * 3)),
    parameters={
        "causal": "bool",
        "scale": "float",
        "return_lse": "bool",
        "kernel": "string",
        "window_size": "string 'L,R' (sliding window in keys, -1: unbounded; default unbounded)",
        "softcap": "float (soft cap of the scores, >= 0; 0, the default: off)",
        "sequence_id": "int or string (a session step; 0 or '' none)",
        "sequence_start": "bool (create the session: k, v required)",
        "sequence_end": "bool (release the session after the step)",
        "layers": "int (with sequence_start; default 1)",
        "layer": "int (a session step's layer; default 0)",
        "datatypes": "q, k, v: FP16, BF16 or FP32 (o follows q)",
        "shapes": "alibi_slopes: [Hq] or [B, Hq] (the input's metadata shows the 2-D form)",
    },
)
ATTENTION_PARAMETERS = ("causal", "scale", "return_lse", "kernel", "window_size", "softcap")
STEP_PARAMETERS = ("causal", "scale", "return_lse", "window_size", "softcap")  # a sequence step's
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "layers", "layer")
LAYER_PARAMETERS = ("causal",)


def layer_model(info: Any) -> Model:
    """The model of a loaded layer (``engine.layer_infos()``'s entry)."""
    dt = OIP_NAMES.get(info.dtype, "FP32")
    return Model(
        name=info.name,
        platform=f"{SERVER_NAME}-{info.family}",
        inputs=(
            TensorSpec("x", dt, (ANY, ANY, info.hidden_size)),
            TensorSpec("positions", "INT64", (ANY, ANY), optional=True),
            TensorSpec("kv_lengths", "INT32", (ANY,), optional=True),
        ),
        outputs=(TensorSpec("y", dt, (ANY, ANY, info.hidden_size)),),
        parameters={"causal": "bool"},
    )


def server_metadata(extensions: Sequence[str]) -> dict[str, Any]:
    """``GET /v2`` / ServerMetadata; ``extensions``: those of the transport's framing."""
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(extensions)}


def model_names(engine: Any) -> list[str]:
    return [ATTENTION, *(i.name for i in engine.layer_infos())]


def find_model(engine: Any, name: str, version: str = "") -> Model:
    """The model ``name`` (at ``version``: "" or VERSION); NotFound names the ones there are."""
    if name == ATTENTION:
        model = ATTENTION_MODEL
    else:
        info = next((i for i in engine.layer_infos() if i.name == name), None)
        if info is None:
            raise NotFound(f"unknown model {name!r}; the models are {', '.join(model_names(engine))}")
        model = layer_model(info)
    if version not in ("", VERSION):
        raise NotFound(f"model {name!r} has no version {version!r}; the only one is {VERSION!r}")
    return model


# ---------------------------------------------------------------- inputs


def check_input_name(model: Model, name: Any, seen: Mapping[str, Any]) -> str:
    """An input's name, before its tensor is decoded: one of the model's, and not given twice."""
    if not isinstance(name, str) or not name:
        raise BadRequest('each input needs a "name", a "shape" and a "datatype"')
    if name in seen:
        raise BadRequest(f"input {name!r}: given twice")
    if name not in model.input_names:
        raise BadRequest(f"input {name!r}: unknown; the inputs of {model.name!r} are {', '.join(model.input_names)}")
    return name


def input_dtype(name: str, datatype: Any) -> torch.dtype:
    if not isinstance(datatype, str):
        raise BadRequest(f"input {name!r}: datatype must be one of {', '.join(OIP_DTYPES)}")
    return dtype_from_name(datatype, OIP_DTYPES)


def input_shape(name: str, shape: Any) -> list[int]:
    return check_shape(shape, f"input {name!r}")


def raw_tensor(name: str, datatype: Any, shape: Any, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """An input sent as raw little-endian row-major bytes (HTTP binary data, gRPC raw contents)."""
    dtype, dims = input_dtype(name, datatype), input_shape(name, shape)
    return aligned(tensor_from_bytes(data, dims, dtype, f"input {name!r}"))


# ---------------------------------------------------------------- the call


@dataclass
class Call:
    """An infer request, decoded: the internal request and the outputs to send, in order."""

    model: Model
    request: AttentionRequest | LayerRequest | SessionStep
    outputs: tuple[str, ...]
    create: dict[str, Any] | None = None  # sequence_start: engine.sessions.create's keywords


def call_id(oip_id: Any, fallback: str | None = None) -> str:
    """The request's id: its protocol ``id`` (cut to MAX_ID characters), else ``fallback``, else new."""
    if isinstance(oip_id, str) and oip_id:
        return oip_id[:MAX_ID]
    return fallback or new_request_id()


def select_outputs(model: Model, requested: Sequence[str] | None, return_lse: bool) -> tuple[str, ...]:
    """The outputs asked for, in their order (once each); none asked: o (and lse with return_lse), or y."""
    if requested is None or len(requested) == 0:
        if model.is_attention:
            return ("o", "lse") if return_lse else ("o",)
        return model.output_names
    for name in requested:
        if name not in model.output_names:
            raise BadRequest(f"unknown output {name!r}; the outputs of {model.name!r} are "
                             f"{', '.join(model.output_names)}")  # fmt: skip
    return tuple(dict.fromkeys(requested))


def build_call(
    model: Model,
    tensors: Mapping[str, torch.Tensor],
    parameters: Mapping[str, Any],
    requested: Sequence[str] | None,
    *,
    request_id: str,
    deadline: float | None,
    arrived: float | None = None,
) -> Call:
    """(model, named inputs, parameters, outputs asked for) -> the internal request and its outputs."""
    sequence = sequence_id(parameters.get("sequence_id"))
    flags = [n for n in ("sequence_start", "sequence_end") if parameters.get(n) not in (None, False, 0, "", "false")]
    if not model.is_attention and (sequence is not None or flags):  # (served as a plain call, it would look kept)
        raise BadRequest(f"model {model.name!r} is a layer, which keeps no sequence: sequence_id and its flags "
                         "are for the 'attention' model's sessions")
    if sequence is not None:
        return sequence_call(model, sequence, tensors, parameters, requested, request_id=request_id,
                             deadline=deadline, arrived=arrived)
    if flags:  # a start or end of no sequence: not a plain call in disguise
        raise BadRequest(f"parameter {flags[0]!r} needs a sequence_id (an integer other than 0, or a "
                         "non-empty string)")
    missing = [t.name for t in model.inputs if not t.optional and t.name not in tensors]
    if missing:
        raise BadRequest(f"missing input{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    known = ATTENTION_PARAMETERS if model.is_attention else LAYER_PARAMETERS
    opts = parse_options({k: v for k, v in parameters.items() if k in known}, "parameter")
    outputs = select_outputs(model, requested, opts.get("return_lse", False))
    arrived = time.monotonic() if arrived is None else arrived
    kv_lengths = kv_lengths_int32(tensors.get("kv_lengths"))
    if not model.is_attention:
        request = LayerRequest(layer=model.name, x=tensors["x"], causal=opts.get("causal", False),
                               positions=tensors.get("positions"), kv_lengths=kv_lengths,
                               request_id=request_id, deadline=deadline, arrived=arrived)  # fmt: skip
        return Call(model, request, outputs)
    opts["return_lse"] = "lse" in outputs
    check_dims(tensors, ("q", "k", "v"), 4, "bhnd")
    request = AttentionRequest(q=tensors["q"], k=tensors["k"], v=tensors["v"], kv_lengths=kv_lengths,
                               alibi_slopes=tensors.get("alibi_slopes"), request_id=request_id,
                               deadline=deadline, arrived=arrived, **opts)  # fmt: skip
    return Call(model, request, outputs)


# Triton's request parameters of extensions the server does not implement: refused, not ignored
# (a client that asked for shared memory would read its region, which nothing wrote)
UNSUPPORTED_TENSOR_PARAMETERS = {
    "shared_memory_region": "shared memory", "shared_memory_byte_size": "shared memory",
    "shared_memory_offset": "shared memory", "classification": "classification",
}


def check_tensor_parameters(where: str, parameters: Mapping[str, Any]) -> None:
    """501 for an input's or output's parameter of a Triton extension the server lacks."""
    for name, feature in UNSUPPORTED_TENSOR_PARAMETERS.items():
        if name in parameters:
            raise Unsupported(f"{where}: parameter {name!r} asks for Triton's {feature} extension, which attnserve "
                              f"does not implement; send the tensor's data in the request (or read it from the "
                              f"response) as JSON or binary data")


def unsupported_extension(feature: str) -> Unsupported:
    """The refusal of a Triton extension's route or rpc (statistics, repository, shared memory,
    trace, logging): what the server serves instead."""
    return Unsupported(f"attnserve does not implement Triton's {feature} extension; it serves the Open "
                       "Inference Protocol's health, metadata and infer calls, binary tensor data, sequences "
                       "and, over HTTP, Triton's model config (GET /v2/models/{model}/config); its metrics are "
                       "at GET /metrics")


def sequence_id(value: Any) -> str | None:
    """``sequence_id`` -> the session id (``str`` of an integer); None for no sequence (absent, 0, "")."""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:  # (JSON's parser: past 64 bits)
        raise BadRequest("parameter 'sequence_id' is an integer past 64 bits; send such an id as a string")
    if isinstance(value, bool) or not (value is None or isinstance(value, int | str)):  # 0.0 and False == 0
        raise BadRequest(f"parameter 'sequence_id' must be an integer or a string, got {value!r}")
    if isinstance(value, int) and value < 0:  # Triton's integer ids are unsigned (uint64)
        raise BadRequest(f"parameter 'sequence_id' must be an integer >= 0 or a string, got {value}")
    if value is None or value == 0 or value == "":
        return None
    return str(value)


def _int_parameter(parameters: Mapping[str, Any], name: str, default: int) -> int:
    value = parameters.get(name, default)
    if isinstance(value, str) and (n := int_text(value)) is not None:
        value = n
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"parameter {name!r} must be an integer, got {value!r}")
    return value


def sequence_call(model: Model, session: str, tensors: Mapping[str, torch.Tensor], parameters: Mapping[str, Any],
                  requested: Sequence[str] | None, *, request_id: str, deadline: float | None,
                  arrived: float | None) -> Call:
    """An ``attention`` call with a sequence id: a session step (and, with sequence_start, its creation)."""
    if "q" not in tensors:
        raise BadRequest("missing input q")
    if "kv_lengths" in tensors:
        raise BadRequest("a sequence step takes no kv_lengths: its keys are the session's")
    flags = {name: parse_bool(name, parameters[name], "parameter") if name in parameters else False
             for name in ("sequence_start", "sequence_end")}
    if "kernel" in parameters:
        raise BadRequest("a sequence step takes no 'kernel' parameter: session steps run the paged kernels; "
                         "drop it from calls with a sequence_id")
    if "layers" in parameters and not flags["sequence_start"]:
        raise BadRequest("parameter 'layers' goes with sequence_start only: a session's layer count is set "
                         "when it starts")
    opts = parse_options({k: v for k, v in parameters.items() if k in STEP_PARAMETERS}, "parameter")
    outputs = select_outputs(model, requested, opts.pop("return_lse", False))
    opts["causal"] = opts.get("causal", True)
    step = SessionStep.single(
        session, tensors["q"], tensors.get("k"), tensors.get("v"), layer=_int_parameter(parameters, "layer", 0),
        alibi_slopes=tensors.get("alibi_slopes"), **opts, return_lse="lse" in outputs,
        end=flags["sequence_end"], request_id=request_id, deadline=deadline,
        arrived=time.monotonic() if arrived is None else arrived,
    )
    create = None
    if flags["sequence_start"]:
        if step.k is None:
            raise BadRequest("sequence_start creates the session from the step's k and v: send both")
        create = {"session": session, "layers": _int_parameter(parameters, "layers", 1),
                  "num_kv_heads": step.heads_kv, "head_dim": step.head_dim, "dtype": step.q.dtype}
    return Call(model, step, outputs, create)


async def infer(engine: Any, call: Call) -> dict[str, torch.Tensor]:
    """Run ``call`` on the engine: output name -> tensor, for the outputs it sends."""
    if isinstance(call.request, SessionStep):
        if call.create is not None:
            created = engine.sessions.create_session(**call.create)  # 409 / ALREADY_EXISTS for a live id
            try:
                res = await engine.sessions.step(call.request)
            except BaseException:  # a start that failed, or whose caller went away, leaves no session behind
                with contextlib.suppress(NotFound):
                    await asyncio.shield(engine.sessions.delete(call.create["session"], only=created))
                raise
        else:
            res = await engine.sessions.step(call.request)
        values = {"o": res.o, "lse": res.lse}
    elif isinstance(call.request, AttentionRequest):
        res = await engine.attend(call.request)
        values = {"o": res.o, "lse": res.lse}
    else:
        res = await engine.call_layer(call.request)
        values = {"y": res.y}
    return {name: values[name] for name in call.outputs}
