"""The span band's numba kernels as ``torch.library`` custom operators (registered on ``import attnkit_adaptive``).

``attnkit_adaptive::span_band(q, k, v, z, kpm, ramp, scale, bq, bk, grad) -> (out, lse, scores, lo, far)``
runs the forward kernel (:func:`.numba_band.forward`; ``lo, far``: each query's reach as the kernels read it, kept
for the backward); its registered autograd runs
``attnkit_adaptive::span_band_backward(q, k, v, z, kpm, out, lse, scores, lo, far, g, ramp, scale, bq)
-> (dq, dk, dv, dz)`` (:func:`.numba_band.backward`: the gradients of q, k, v **and of the spans** z, in z's
shape). The fake implementations give the output shapes from the input shapes alone, so ``torch.export`` (a
static or a dynamic length) and ``torch.compile`` hold one operator; everything that reads values on the host (each
query's reach from its span, the widest reach, the decision to keep the scores) runs inside the real
implementation, on real tensors, when the program runs. ``scores`` (the forward's kept scaled scores for the
backward, ``(B·H, L, widest reach + 1)``, or ``(B·H, L, 0)`` when none were kept: ``grad`` False, or more than
:data:`.numba_band.SCORES_MAX_BYTES`) has a data-dependent last size: an unbacked size while tracing with
``grad``, 0 without.

This module imports neither numba nor the kernels (:mod:`.numba_band` is imported by the real implementations on
their first call), so ``attnkit_adaptive`` can register the operators on import and ``torch.export.load`` of a
program on the numba backend needs only ``import attnkit_adaptive``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.first_order import first_order

__all__ = ["NAMESPACE", "span_band", "span_band_backward"]

NAMESPACE = "attnkit_adaptive"


def _forward(q: Tensor, k: Tensor, v: Tensor, z: Tensor, kpm: Tensor | None, ramp: float, scale: float, bq: int,
             bk: int, grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from . import numba_band  # numba is imported only when the kernels run

    return numba_band.forward(q, k, v, z, kpm, ramp, scale, bq, bk, grad)


def _forward_fake(q, k, v, z, kpm, ramp, scale, bq, bk, grad):
    B, H, L, _ = q.shape
    width = torch.library.get_ctx().new_dynamic_size() if grad else 0   # the widest reach + 1, read at run time
    return (q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L), q.new_empty(B * H, L, width),
            q.new_empty(B, H, L, dtype=torch.int32), q.new_empty(B * H, dtype=torch.int32))


def _backward(q: Tensor, k: Tensor, v: Tensor, z: Tensor, kpm: Tensor | None, out: Tensor, lse: Tensor,
              scores: Tensor, lo: Tensor, far: Tensor, g: Tensor, ramp: float, scale: float,
              bq: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from . import numba_band

    return numba_band.backward(q, k, v, z, kpm, out, lse, scores, lo, far, g, ramp, scale, bq)


def _backward_fake(q, k, v, z, kpm, out, lse, scores, lo, far, g, ramp, scale, bq):
    # contiguous, as the kernels write them (not empty_like: dynamic-span's spans come out of an einsum with other
    # strides, and a compiled backward reshapes the gradient by the strides it was told)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), z.new_empty(z.shape)


span_band_backward = torch.library.custom_op(f"{NAMESPACE}::span_band_backward", mutates_args=())(_backward)
span_band_backward.register_fake(_backward_fake)

span_band = torch.library.custom_op(f"{NAMESPACE}::span_band", mutates_args=())(_forward)
span_band.register_fake(_forward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, z, kpm, ramp, scale, bq, bk, grad = inputs
    out, lse, scores, lo, far = output
    ctx.save_for_backward(q, k, v, z, kpm, out, lse, scores, lo, far)
    ctx.ramp, ctx.scale, ctx.bq = ramp, scale, bq
    ctx.mark_non_differentiable(lse, scores, lo, far)
    # no zeros for the unused outputs' gradients (the kept scores are B·H·L·(far + 1) floats: a zero fill of them
    # cost 2-6 ms per backward at 4K, H = 8)
    ctx.set_materialize_grads(False)


def _autograd(ctx, g_out, *_):
    q, k, v, z, kpm, out, lse, scores, lo, far = ctx.saved_tensors
    if g_out is None:
        return (None,) * 10
    dq, dk, dv, dz = span_band_backward(q, k, v, z, kpm, out, lse, scores, lo, far, g_out.contiguous(),
                                        ctx.ramp, ctx.scale, ctx.bq)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dz if need[3] else None,
            *([None] * 6))


span_band.register_autograd(first_order(_autograd), setup_context=_setup_context)
