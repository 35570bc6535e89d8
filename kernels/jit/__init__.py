"""Device code: the ``@triton.jit`` and ``@gluon.jit`` kernels and their autotune tables, nothing else.

The launchers one level up (``kernels/flash.py``, ``kernels/flash_v1.py``, ``kernels/autograd.py``)
check inputs, allocate outputs, choose a kernel and launch it; these modules only say what runs on
the GPU.

- ``flash_fwd``: ``attn_fwd`` (FA2 order, split-KV capable), ``attn_fwd_tma`` (TMA prefill),
  ``attn_combine`` (the LSE merge of split partials) and their autotune configs;
- ``gluon_fwd``: ``attn_fwd_ws``, the D 128 prefill on Hopper (Gluon, warp-specialised);
- ``gluon_decode``: ``attn_decode``, the packed or split decode on Hopper (Gluon, TMA);
- ``flash_v1``: ``flash_v1_fwd``, the seed's V1 loop order;
- ``flash_bwd``: ``bwd_preprocess``, ``bwd_dkdv``, ``bwd_dq``;
- ``tuning``: how their autotuners time a config.
"""
