"""The gRPC client's earlier import path, kept so that existing code keeps working: the client lives
in ``service.client.grpc`` (``from service.client import GrpcAttentionClient``)."""

from service.client.grpc import GrpcAttentionClient, GrpcAttentionServiceError  # noqa: F401
