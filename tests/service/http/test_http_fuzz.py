"""Property-based fuzzing of every HTTP route from the app's own OpenAPI schema (schemathesis):
no case may produce a 5xx, and every error answer has the contract's JSON error body.

The ASGI app runs in-process over a small engine that validates and computes exactly like the real
one but without workers (the transport is what is under test here; tests/service/http/test_http.py covers the
real server)."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from starlette.requests import ClientDisconnect, Request

import kernels
from service.core.types import AttentionResult
from service.errors import BadRequest, NotFound, from_kernel_error
from service.http.app import create_app
from service.http.body import read_body
from service.settings import Settings


class SmallEngine:
    """The engine interface (service/engine.py) computed inline with the reference kernel."""

    ready = True
    metrics_registry = None

    def layer_infos(self) -> list:
        return []

    async def attend(self, req):
        try:
            o, lse = kernels.attention(
                req.q,
                req.k,
                req.v,
                causal=req.causal,
                scale=req.scale,
                kv_lengths=req.kv_lengths,
                return_lse=True,
                kernel="reference",
            )
        except kernels.AttentionInputError as exc:
            raise from_kernel_error(exc) from None
        o = o.transpose(1, 2).contiguous() if req.layout == "bnhd" else o
        return AttentionResult(o=o, lse=lse if req.return_lse else None, request_id=req.request_id)

    async def call_layer(self, req):
        raise NotFound(f"unknown layer {req.layer!r}")


ST_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "F64": 8, "U8": 1}


@st.composite
def safetensors_files(draw) -> bytes:
    """Mostly well-formed safetensors files of small tensors (right and wrong names, shapes, dtypes,
    metadata), sometimes truncated or with garbage in the header."""
    header: dict = {}
    data = b""
    names = draw(
        st.lists(
            st.sampled_from(["q", "k", "v", "kv_lengths", "x", "positions", "casual", "alibi_slopes"]),
            min_size=0,
            max_size=4,
            unique=True,
        )
    )
    for name in names:
        dtype = draw(st.sampled_from(list(ST_DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=5))
        numel = 1
        for d in shape:
            numel *= d
        n = numel * ST_DTYPES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += draw(st.binary(min_size=n, max_size=n))
    meta = draw(
        st.dictionaries(
            st.sampled_from(["causal", "scale", "layout", "return_lse", "kernel", "format", "x", "window_size",
                             "softcap"]),
            st.sampled_from(["true", "false", "0.5", "bnhd", "bhnd", "flash", "nan", "", "3,0", "-2,0", "1,2,3",
                             "-1", "1e309"]),
            max_size=3,
        )
    )
    if meta:
        header["__metadata__"] = meta
    head = orjson.dumps(header)
    body = struct.pack("<Q", len(head)) + head + data
    mutation = draw(st.sampled_from(["none"] * 6 + ["truncate", "garbage"]))
    if mutation == "truncate":
        body = body[: draw(st.integers(0, len(body)))]
    elif mutation == "garbage":
        i = draw(st.integers(0, len(body)))
        body = body[:i] + draw(st.binary(max_size=16)) + body[i:]
    return body


schemathesis.openapi.media_type("application/x-safetensors", safetensors_files())

APP = create_app(SmallEngine(), Settings(max_body_mb=1.0))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call()
    status = response.status_code
    if status == 504:  # a legitimate answer when the case set a (tiny) deadline
        assert "X-Request-Timeout-Ms" in (case.headers or {}), response.text
    else:
        assert status < 500, f"{case.method} {case.path} -> {status}: {response.text}"
    if response.status_code >= 400:
        err = response.json()["error"]
        if case.path.startswith("/v2"):
            assert isinstance(err, str) and err
        else:
            assert set(err) == {"code", "message"} and err["message"]


class BrokenEngine(SmallEngine):
    """Not ready, and failing with a bug: what the edges of the app must still answer cleanly."""

    ready = False

    async def attend(self, req):
        raise RuntimeError("a bug with a secret in its message")


def test_not_ready_and_internal_errors():
    from starlette.testclient import TestClient

    q = [[[[1.0, 0.0]]]]
    with TestClient(create_app(BrokenEngine(), Settings()), raise_server_exceptions=False) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/v2/health/live").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        r = client.get("/v2/health/ready")
        assert r.status_code == 503 and isinstance(r.json()["error"], str)
        r = client.post("/attention", json={"q": q, "k": q, "v": q})
        assert r.status_code == 500
        assert r.json() == {"error": {"code": "internal", "message": "internal server error"}}
        r = client.post(
            "/v2/models/attention/infer",
            json={
                "inputs": [
                    {"name": n, "shape": [1, 1, 1, 2], "datatype": "FP32", "data": [1.0, 0.0]} for n in "qkv"
                ]
            },
        )
        assert r.status_code == 500 and r.json() == {"error": "internal server error"}
        assert 'status="500"' in client.get("/metrics").text


def test_body_memory_follows_the_bytes_sent():
    """A body that claims a large Content-Length and sends 10 bytes holds about 10 bytes, not the
    claimed size (preallocating the claim would let idle connections pin GiBs)."""
    claimed = 256 << 20

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"0123456789", "more_body": True}
        raise ClientDisconnect()

    sent: list = []
    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", str(claimed).encode())]}
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest, match="disconnected"):
            asyncio.run(read_body(Request(scope, receive), limit=claimed))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes held for a 10-byte body"
