"""The positive map's causal form under autograd on the numba backend: one operator from ``q, k, v`` to the output.

On the unfused path a training step runs the features as two operators (:mod:`.numba_features`) and linear
attention as a third (:mod:`attnkit_kernelized.linear.numba_ops`); the backward then writes ``d phi_q`` and
``d phi_k`` (``(B, H, L, M)`` each: 64 MiB at L = 8,192, H = 8, M = 256) from two products and reads them back,
with the features, in the features' backward. :data:`numba_performer_causal` is one differentiable operator
whose backward runs the features' backward on each block of those two products while the block is in cache
(:func:`attnkit_kernelized.linear.numba_ops._product_features`): ``d phi`` is never written. The backward's
inputs ``[g / den, -(g . out) / den]`` and ``[v, 1]`` come from one numba pass
(``numba_linear_backward_inputs``).

Forward: ``phi_q = exp(q W'^T - max)`` per row, ``phi_k = exp(k W'^T - scale |k|^2 / 2)`` (0 at padded keys),
their bounds ``hi``, ``lo`` (what :meth:`.module.PerformerAttention._bounded_causal` decides by: outside them the
caller discards the result for the log-space form), then normalised causal linear attention from the state
``(S0, z0)``. Backward, with ``g' = [d num, d den]`` and ``w' = [v, 1]`` as in
:func:`attnkit_kernelized._ops.linear_attention_backward`::

    dq = (product(g', w', phi_k, S'_0^T) * phi_q) W'
    dk = (product(w', g', phi_q, G^T, reversed) * phi_k) W' - scale · rowsum(...) · k    (0 at padded keys)
    dv = product(phi_k, phi_q, d num, d S_L, reversed)

the same formulas as the unfused operators', in the same order (the results agree to rounding).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .._busy import busy_threads
from .._ops import _seq, backward_products, define
from ..linear.numba_ops import numba_linear_backward_inputs, numba_linear_product, numba_linear_product_features
from .numba_fused import run_fused

__all__ = ["numba_performer_causal", "performer_causal"]


def _causal(q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, pad: Tensor | None, S0: Tensor, z0: Tensor,
            chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out, S, z, hi, lo, phi_q, phi_k, den = run_fused(q, k, v, w, scale, pad, S0, z0, chunk, float("inf"), True)
    return out, den, S, z, phi_q, phi_k, hi, lo


def _causal_fake(q, k, v, w, scale, pad, S0, z0, chunk):
    B, H, L, _ = q.shape
    M = w.shape[0]
    return (v.new_empty(B, H, L, v.shape[-1]), v.new_empty(B, H, L), S0.new_empty(S0.shape), z0.new_empty(z0.shape),
            q.new_empty(B, H, L, M), q.new_empty(B, H, L, M), q.new_empty(B, H, M), q.new_empty(B, H))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, w, scale, pad, S0, z0, chunk = inputs
    out, den, _, _, phi_q, phi_k, hi, lo = output
    ctx.mark_non_differentiable(den, phi_q, phi_k, hi, lo)
    ctx.save_for_backward(k, v, w, pad, S0, z0, out, den, phi_q, phi_k)
    ctx.scale, ctx.chunk = scale, chunk
    ctx.device = q.device        # not read back from ctx.saved_tensors: checkpointing allows one unpack
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, g_out: Tensor | None, _g_den: Tensor | None, g_S: Tensor | None, g_z: Tensor | None,
              *_rest: Any) -> tuple[Tensor | None, ...]:
    with busy_threads(ctx.device):       # see .._busy: one torch thread on a busy machine
        return _backward_body(ctx, g_out, g_S, g_z)


def _backward_body(ctx: Any, g_out: Tensor | None, g_S: Tensor | None, g_z: Tensor | None
                   ) -> tuple[Tensor | None, ...]:
    """The linear backward (:func:`.._ops.backward_products`, the numba products and one-pass inputs) with its
    ``d phi_q`` and ``d phi_k`` products replaced by the features-epilogue ones: ``dq``, ``dk`` directly."""
    k, v, w, pad, S0, z0, out, den, phi_q, phi_k = ctx.saved_tensors
    need_q, need_k, need_v, _, _, _, need_S0, need_z0 = ctx.needs_input_grad[:8]
    B, H, L, _ = phi_q.shape
    N = B * H
    chunk = ctx.chunk
    padn = None if pad is None else pad[:, 0, :, 0].reshape(B, 1, L).expand(B, H, L).reshape(N, L).contiguous()

    def dq_of(gp: Tensor, vp: Tensor, Sp0T: Tensor, no_z: Tensor) -> Tensor:
        return numba_linear_product_features(gp, vp, _seq(phi_k), Sp0T, no_z, False, chunk, _seq(phi_q), w, None,
                                             None, 0.0)[0]

    def dk_of(vp: Tensor, gp: Tensor, GT: Tensor, no_z: Tensor) -> tuple[Tensor, Tensor]:
        dk, dSpT, _ = numba_linear_product_features(vp, gp, _seq(phi_q), GT, no_z, True, chunk, _seq(phi_k), w,
                                                    _seq(k), padn, ctx.scale)
        return dk, dSpT

    dq, dk, dv, dS0, dz0 = backward_products(
        numba_linear_product, phi_q, phi_k, v, S0, z0, out, den, (need_q, need_k, need_v, need_S0, need_z0), True,
        chunk, g_out, None, g_S, g_z, numba_linear_backward_inputs, dq_of, dk_of)
    return dq, dk, dv, None, None, None, dS0, dz0, None


#: ``attnkit_kernelized::numba_performer_causal``: ``(q, k, v (B, H, L, D|E), w (M, D), scale, pad (B, 1, L, 1)
#: or None, S0 (B, H, M, E), z0 (B, H, M), chunk) -> (out (B, H, L, E), den (B, H, L), S, z, phi_q, phi_k,
#: hi (B, H, M), lo (B, H))``, differentiable in ``q``, ``k``, ``v``, ``S0`` and ``z0``
numba_performer_causal = define("numba_performer_causal", _causal, _causal_fake, backward=_backward,
                                setup_context=_setup)


def performer_causal(q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, pad: Tensor | None,
                     S0: Tensor | None, z0: Tensor | None, chunk: int
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Causal performer attention with the positive map from ``(S0, z0)`` (None: zeros), differentiable.

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; float32 or float64 CPU tensors of one dtype.
        w: ``(M, D)``, the random projection times ``sqrt(scale)`` (no gradient).
        scale: the attention scale.
        pad: ``(B, 1, L, 1)`` bool, True at padded keys, or None.
        S0, z0: ``(B, H, M, E)``, ``(B, H, M)``: the state relative to exponent 0, or None.
        chunk: positions per kernel block (at most :data:`attnkit_kernelized.linear.numba_ops.MAX_BLOCK`).

    Returns:
        ``(out (B, H, L, E), S, z, hi (B, H, M), lo (B, H))``: the normalised output (0 where a query sees no
        key), the state after the last key (relative to exponent 0), the largest key exponent per feature and
        the smallest of each sequence (what decides whether this form may be used; see
        :meth:`.module.PerformerAttention._bounded_causal`).
    """
    B, H, _, _ = q.shape
    M, E = w.shape[0], v.shape[-1]
    if S0 is None:
        S0 = q.new_zeros(B, H, M, E)
    if z0 is None:
        z0 = q.new_zeros(B, H, M)
    out, _, S, z, _, _, hi, lo = numba_performer_causal(q, k, v, w.detach().to(q.dtype), float(scale), pad, S0, z0,
                                                        int(chunk))
    return out, S, z, hi, lo
