"""The gRPC transport: the servicers and their interceptor (``server``), the one error mapping
(``errors``), protobuf <-> internal requests (``codec``), the Open Inference Protocol's gRPC framing
(``oip``) and the stubs generated from ``proto/`` (``protogen``)."""
