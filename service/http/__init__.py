"""The HTTP transport: FastAPI routes (``app``), JSON/safetensors <-> internal requests (``codec``),
the Open Inference Protocol's HTTP framing (``oip``) and the one patch over uvicorn's internals
(``uvicorn_patch``)."""
