"""The wire encodings of the load tests' requests and the checks of their answers (no Locust in here).

Each ``*_body`` builds one request from a prepared shape (``payloads.Prepared``: q and k built once)
with a fresh v and returns what its answer must be (``payloads.Expected``); each ``check_*`` parses
an answer of that encoding and checks it, raising ``payloads.WrongAnswer``. Encodings: safetensors
(POST /attention), JSON with base64 data or nested lists, the Open Inference Protocol's binary
tensor extension, and attention.v1's AttendRequest for gRPC.
"""

from __future__ import annotations

import base64
import json
import random
import struct

import numpy as np

from loadtest.payloads import DTYPE_CODES, OIP_TO_NAME, ST_TO_NAME, Expected, Prepared, WrongAnswer

# ---------------------------------------------------------------- encodings: safetensors


def safetensors_header(tensors: list[tuple[str, str, list[int], int]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header of a safetensors file whose data are ``tensors`` in order
    (name, dtype, shape, nbytes); the caller appends the raw bytes."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": DTYPE_CODES[dtype][0], "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def safetensors_body(p: Prepared, rng: random.Random) -> tuple[bytes, Expected]:
    s = p.shape
    exp, v = p.fresh_v(rng)
    hdr = p.cache.get("st")
    if hdr is None:
        hdr = p.cache["st"] = safetensors_header(
            [("q", s.dtype, s.q_shape, len(p.q)), ("k", s.dtype, s.kv_shape, len(p.k)),
             ("v", s.dtype, s.kv_shape, len(v))])
    return b"".join((hdr, p.q, p.k, v)), exp


def parse_safetensors(body: bytes) -> dict[str, tuple[str, list[int], memoryview]]:
    """safetensors bytes -> {name: (dtype name, shape, raw bytes)} without copying the data."""
    if len(body) < 8:
        raise WrongAnswer(f"response of {len(body)} bytes is not a safetensors file")
    (n,) = struct.unpack_from("<Q", body)
    try:
        header = json.loads(body[8:8 + n])
    except ValueError as e:
        raise WrongAnswer(f"response is not a safetensors file: {e}") from None
    data = memoryview(body)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (ST_TO_NAME.get(info["dtype"], info["dtype"]), info["shape"], data[a:b])
    return out


def check_safetensors(body: bytes, exp: Expected) -> None:
    tensors = parse_safetensors(body)
    if "o" not in tensors:
        raise WrongAnswer(f"response holds {sorted(tensors)}, no 'o'")
    dtype, shape, raw = tensors["o"]
    exp.check_header(shape, dtype)
    exp.check_bits(raw)


# ---------------------------------------------------------------- encodings: JSON


def json_b64_body(p: Prepared, rng: random.Random) -> tuple[bytes, Expected]:
    """{"q": {"shape", "dtype", "data": base64}, ...}: exact for every dtype."""
    s = p.shape
    exp, v = p.fresh_v(rng)
    head = p.cache.get("json-b64")
    if head is None:
        def t(shape, raw):
            return {"shape": shape, "dtype": s.dtype, "data": base64.b64encode(raw).decode()}
        head = p.cache["json-b64"] = json.dumps(
            {"q": t(s.q_shape, p.q), "k": t(s.kv_shape, p.k), "causal": s.causal})[:-1].encode()
    tail = json.dumps({"shape": s.kv_shape, "dtype": s.dtype, "data": base64.b64encode(v).decode()}).encode()
    return b"".join((head, b', "v": ', tail, b"}")), exp


def _nested(shape: list[int], leaf: str) -> str:
    """Text of a nested JSON list of ``shape`` whose innermost lists are all ``leaf``."""
    text = leaf
    for n in reversed(shape[:-1]):
        text = "[" + ",".join([text] * n) + "]"
    return text


def json_list_body(p: Prepared, rng: random.Random) -> tuple[bytes, Expected]:
    """{"q": [[[[...]]]], ...}: nested float32 lists, the plainest JSON a client can send."""
    s = p.shape
    assert s.dtype == "float32", "nested JSON lists are float32"
    exp, _ = p.fresh_v(rng)
    head = p.cache.get("json-list")
    if head is None:
        def t(shape, raw):
            return np.frombuffer(raw, dtype=np.float32).reshape(shape).tolist()
        head = p.cache["json-list"] = json.dumps(
            {"q": t(s.q_shape, p.q), "k": t(s.kv_shape, p.k), "causal": s.causal})[:-1].encode()
    row = "[" + ",".join(repr(float(x)) for x in exp.c) + "]"
    return b"".join((head, b', "v": ', _nested(s.kv_shape, row).encode(), b"}")), exp


def check_json(body: bytes, exp: Expected) -> None:
    try:
        doc = json.loads(body)
        o = doc["o"]
    except (ValueError, KeyError, TypeError) as e:
        raise WrongAnswer(f"response is not {{'o': tensor}}: {e!r}") from None
    if isinstance(o, dict):  # {"shape", "dtype", "data": base64 | flat list}
        exp.check_header(o.get("shape"), o.get("dtype"))
        data = o.get("data")
        if isinstance(data, str):
            exp.check_bits(base64.b64decode(data))
        else:
            exp.check_array(np.asarray(data, dtype=np.float32).reshape(exp.shape))
    else:
        arr = np.asarray(o, dtype=np.float32)
        exp.check_array(arr)


# ---------------------------------------------------------------- encodings: Open Inference Protocol


def oip_body(p: Prepared, rng: random.Random) -> tuple[bytes, dict[str, str], Expected]:
    """KServe v2 infer with the binary tensor data extension: JSON header, then q, k, v bytes."""
    s = p.shape
    exp, v = p.fresh_v(rng)
    head = p.cache.get("oip")
    if head is None:
        dt = DTYPE_CODES[s.dtype][1]
        def t(name, shape, nbytes):
            return {"name": name, "shape": shape, "datatype": dt, "parameters": {"binary_data_size": nbytes}}
        head = p.cache["oip"] = json.dumps({
            "inputs": [t("q", s.q_shape, len(p.q)), t("k", s.kv_shape, len(p.k)), t("v", s.kv_shape, len(v))],
            "outputs": [{"name": "o", "parameters": {"binary_data": True}}],
            "parameters": {"causal": s.causal},
        }, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    return b"".join((head, p.q, p.k, v)), headers, exp


def check_oip(body: bytes, header_length: str | None, exp: Expected) -> None:
    n = int(header_length) if header_length else len(body)
    try:
        doc = json.loads(body[:n])
        outputs = doc["outputs"]
    except (ValueError, KeyError, TypeError) as e:
        raise WrongAnswer(f"response is not an OIP infer response: {e!r}") from None
    offset = n
    for out in outputs:
        size = (out.get("parameters") or {}).get("binary_data_size")
        if out.get("name") != "o":
            offset += size or 0
            continue
        exp.check_header(out.get("shape"), OIP_TO_NAME.get(out.get("datatype"), out.get("datatype")))
        if size is None:  # the server chose JSON data
            exp.check_array(np.asarray(out["data"], dtype=np.float32).reshape(exp.shape))
        else:
            exp.check_bits(memoryview(body)[offset:offset + size])
        return
    raise WrongAnswer(f"response has outputs {[o.get('name') for o in outputs]}, no 'o'")


# ---------------------------------------------------------------- encodings: attention.v1 (gRPC)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited protobuf field (its payload follows)."""
    return _varint(number << 3 | 2) + _varint(length)


def grpc_attend_body(p: Prepared, rng: random.Random, pb) -> tuple[bytes, Expected]:
    """A serialized ``attention.v1.AttendRequest`` (``pb``: its generated module) with a fresh v.

    q, k and the options are serialized once per prepared shape; each call appends the v field
    (AttendRequest.v = 3, Tensor.data = 3) by hand, so a call costs one join of its bytes. Built
    as messages, q, k and v would be copied into the message and again when serialized, several
    times the cost of a prefill request this way, enough to saturate the load generator's CPU
    with a few hundred prefill users (docs/loadtest.md). Concatenated serialized messages parse
    as one (protobuf merges them), so the server sees the same request."""
    s = p.shape
    code = DTYPE_CODES[s.dtype][2]
    head = p.cache.get("grpc")
    if head is None:
        prefix = pb.AttendRequest(q=pb.Tensor(shape=s.q_shape, dtype=code, data=p.q),
                                  k=pb.Tensor(shape=s.kv_shape, dtype=code, data=p.k),
                                  causal=s.causal).SerializeToString()
        head = p.cache["grpc"] = (prefix, pb.Tensor(shape=s.kv_shape, dtype=code).SerializeToString())
    prefix, v_head = head
    exp, v = p.fresh_v(rng)
    data = _field(3, len(v))
    return b"".join((prefix, _field(3, len(v_head) + len(data) + len(v)), v_head, data, v)), exp
