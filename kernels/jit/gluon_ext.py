"""Two Hopper operations Gluon's language in triton 3.6 does not expose, built on what it has.

- ``tma_reduce_add``: a TMA reduce-add of a shared-memory tile into global memory
  (``cp.reduce.async.bulk.tensor``). Triton's own ``ttng.async_tma_reduce`` op and its lowering
  exist (``TensorDescriptor.atomic_add`` uses them in Triton's language); this emits that op from
  Gluon through the builder's ``create_async_tma_reduce``, a binding Gluon's ``tma`` module does
  not wrap yet. Completion is tracked like a TMA store's (``tma.store_wait``).
- ``bulk_wait_written``: wait until this thread's bulk copies have *written* their destinations
  (``cp.async.bulk.wait_group 0``); ``tma.store_wait`` waits only until they have read their source.

The Hopper backward's dQ goes out through them (``gluon_bwd.py``); ``hopper_bwd.GLUON_BACKWARD``
switches that kernel, and so these, off. They reach past Gluon's public language, so a Triton
upgrade checks them first: the CPU compile tests in tests/kernels/test_backward.py look for the
reduce in the PTX.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[the descriptor's box at coord] += src (shared memory, the box's layout), element by
    element and atomically; boxes past the tensor's bounds add nothing there."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def bulk_wait_written(token):
    """Block until every bulk copy this thread issued has written its destination. ``token`` is
    any int32 scalar: inline assembly needs an operand."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.b32 $0, $1;", "=r,r", [token],
                              dtype=gl.int32, is_pure=False, pack=1)
