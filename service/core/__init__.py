"""The transport-neutral core: one internal request type (``types``), admission (``engine``), the
dynamic batcher (``batcher``), one worker per device (``worker``) and the Prometheus series
(``metrics``). Transports build ``types.AttentionRequest``/``LayerRequest`` and await the engine."""
