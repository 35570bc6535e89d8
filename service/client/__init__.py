"""Python clients of the service, one interface over two transports.

    from service.client import AttentionClient, GrpcAttentionClient
    o = AttentionClient("http://localhost:8000").attention(q, k, v, causal=True)
    o = GrpcAttentionClient("localhost:8001").attention(q, k, v, causal=True)
    with AttentionClient("http://localhost:8000").session(num_kv_heads=8, head_dim=128) as s:
        o = s.step(q, k, v)                                  # sessions (docs/api.md#sessions): a ``Session``

The gRPC client is imported on first use: the HTTP client needs neither grpcio nor the stubs.
``service.client.transformers`` (``SessionCache``, ``use_attnserve``) runs a Hugging Face model's
``generate()`` on sessions; it imports transformers, so nothing here imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.client.http import AttentionClient, AttentionServiceError
from service.client.sessions import Session

if TYPE_CHECKING:
    from service.client.grpc import GrpcAttentionClient, GrpcAttentionServiceError

__all__ = ["AttentionClient", "AttentionServiceError", "GrpcAttentionClient", "GrpcAttentionServiceError", "Session"]


def __getattr__(name: str) -> Any:
    if name in ("GrpcAttentionClient", "GrpcAttentionServiceError"):
        from service.client import grpc

        return getattr(grpc, name)
    raise AttributeError(name)
