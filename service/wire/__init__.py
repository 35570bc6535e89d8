"""What the transports and the clients share: tensors in safetensors and raw bytes, dtype names,
shape checks (``tensors``); one parser per option (``options``); the Open Inference Protocol apart
from its framing (``oip``)."""

# The header (gRPC metadata) the clients put on every session call: the affinity key a gateway
# hashes on to pick the replica (docs/deploy.md). The server itself routes by the session id.
SESSION_HEADER = "x-attnserve-session"
