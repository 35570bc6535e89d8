"""The HTTP transport: the app wired (``app``); native routes (``routes``) and their wire format
(``codec``, JSON tensors in ``json_tensors``); the Open Inference Protocol's HTTP framing and routes
(``oip``); health and metrics (``ops``); bodies in and answers out (``body``); the edge middleware
(``edge``); the one error mapping (``errors``); the OpenAPI document (``openapi``); and the one
patch over uvicorn's internals (``uvicorn_patch``)."""
