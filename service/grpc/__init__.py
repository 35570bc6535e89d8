"""The gRPC transport: the servicers and their error interceptor (``server``), protobuf <-> internal
requests (``codec``), the Open Inference Protocol's gRPC framing (``oip``) and the stubs generated
from ``proto/`` (``protogen``)."""
