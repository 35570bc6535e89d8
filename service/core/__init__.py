"""The transport-neutral core: one internal request type (``types``), admission (``engine``), the
dynamic batcher (``batcher``), one worker per device (``worker``: its launches in ``launches``, its
staging copies in ``staging``, its CUDA graphs in ``graphs``; device and memory sizing in
``devices``) and the Prometheus series (``metrics``). Transports build
``types.AttentionRequest``/``LayerRequest`` and await the engine."""
