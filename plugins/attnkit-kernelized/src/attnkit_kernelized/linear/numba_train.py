"""``linear``'s causal form with the ``elu`` map under autograd on the numba backend: one operator from ``q, k, v``.

On the unfused path a training step runs ``elu(x) + 1`` as two operators (:mod:`.numba_elu`: a pass over q and
one over k, each writing its features) and linear attention as a third (:mod:`.numba_ops`); the backward then
writes ``d phi_q`` and ``d phi_k`` from two products and reads them back, with the features, in two more passes of
the map's backward. Those four passes are short and memory-bound: on a machine another process keeps busy they
slowed 4-5x where the products slowed about 2x (docs/benchmarks.md, "Session 65").

:data:`numba_linear_causal` is one differentiable operator. Its forward is the fused kernel of
:mod:`.numba_fused` (each block's features formed in cache, the product on them), which also writes the features
and the denominators the backward needs. Its backward runs the map's backward on each block of the two products
while the block is in cache (:func:`.numba_ops._product_elu`): ``d phi`` is never written. With ``s`` the square
root of the attention scale (1 without one), ``g' = [d num, d den]`` and ``w' = [v, 1]`` as in
:func:`attnkit_kernelized._ops.linear_attention_backward`::

    dq = s · product(g', w', phi_k, S'_0^T) · min(phi_q, 1)
    dk = s · product(w', g', phi_q, G^T, reversed) · min(phi_k, 1)          (0 at padded keys: phi_k is 0)
    dv = product(phi_k, phi_q, d num, d S_L, reversed)

(``min(phi, 1)`` is the map's derivative: 1 where ``s x > 0``, ``exp(s x) = phi`` elsewhere), the same formulas as
the unfused operators' in the same order: the results agree with them to rounding.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .._busy import busy_threads
from .._ops import _seq, backward_products, define
from .numba_fused import run_fused
from .numba_ops import numba_linear_backward_inputs, numba_linear_product, numba_linear_product_elu

__all__ = ["linear_causal", "numba_linear_causal"]


def _causal(q: Tensor, k: Tensor, v: Tensor, scale: float, pad: Tensor | None, S0: Tensor, z0: Tensor,
            chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out, S, z, phi_q, phi_k, den = run_fused(q, k, v, scale, pad, S0, z0, chunk, True)
    return out, den, S, z, phi_q, phi_k


def _causal_fake(q, k, v, scale, pad, S0, z0, chunk):
    B, H, L, D = q.shape
    return (v.new_empty(B, H, L, v.shape[-1]), v.new_empty(B, H, L), S0.new_empty(S0.shape), z0.new_empty(z0.shape),
            q.new_empty(B, H, L, D), q.new_empty(B, H, L, D))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, scale, pad, S0, z0, chunk = inputs
    out, den, _, _, phi_q, phi_k = output
    ctx.mark_non_differentiable(den, phi_q, phi_k)
    ctx.save_for_backward(v, S0, z0, out, den, phi_q, phi_k)
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
    ``d phi_q`` and ``d phi_k`` products replaced by the map's-backward-epilogue ones: ``dq``, ``dk`` directly."""
    v, S0, z0, out, den, phi_q, phi_k = ctx.saved_tensors
    need_q, need_k, need_v, _, _, need_S0, need_z0, _ = ctx.needs_input_grad
    chunk, scale = ctx.chunk, ctx.scale

    def dq_of(gp: Tensor, vp: Tensor, Sp0T: Tensor, no_z: Tensor) -> Tensor:
        return numba_linear_product_elu(gp, vp, _seq(phi_k), Sp0T, no_z, False, chunk, _seq(phi_q), scale)[0]

    def dk_of(vp: Tensor, gp: Tensor, GT: Tensor, no_z: Tensor) -> tuple[Tensor, Tensor]:
        dk, dSpT, _ = numba_linear_product_elu(vp, gp, _seq(phi_q), GT, no_z, True, chunk, _seq(phi_k), scale)
        return dk, dSpT

    dq, dk, dv, dS0, dz0 = backward_products(
        numba_linear_product, phi_q, phi_k, v, S0, z0, out, den, (need_q, need_k, need_v, need_S0, need_z0), True,
        chunk, g_out, None, g_S, g_z, numba_linear_backward_inputs, dq_of, dk_of)
    return dq, dk, dv, None, None, dS0, dz0, None


#: ``attnkit_kernelized::numba_linear_causal``: ``(q, k (B, H, L, D), v (B, H, L, E), scale, pad (B, 1, L, 1) or
#: None, S0 (B, H, D, E), z0 (B, H, D), chunk) -> (out (B, H, L, E), den (B, H, L), S, z, phi_q, phi_k
#: (B, H, L, D))``, differentiable in ``q``, ``k``, ``v``, ``S0`` and ``z0``
numba_linear_causal = define("numba_linear_causal", _causal, _causal_fake, backward=_backward, setup_context=_setup)


def linear_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, pad: Tensor | None, S0: Tensor | None,
                  z0: Tensor | None, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Causal linear attention with ``phi(x) = elu(scale x) + 1`` from ``(S0, z0)`` (None: zeros), differentiable.

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; float32 or float64 CPU tensors of one dtype.
        scale: the factor q and k are multiplied by before the map (1.0: none).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (their features are 0, and so are their gradients in ``k``,
            whatever they hold; ``v`` must be 0 there, as the module makes it), or None.
        S0, z0: the state ``(B, H, D, E)``, ``(B, H, D)`` carried in (None: zeros).
        chunk: positions per kernel block (at most :data:`.numba_ops.MAX_BLOCK`).

    Returns:
        ``(out (B, H, L, E), S (B, H, D, E), z (B, H, D))``: the output (0 where a query sees no key) and the
        state after the last key.

    Raises:
        ValueError: inputs that are not float32/float64 CPU tensors of one dtype and length.
    """
    B, H, _, D = q.shape
    E = v.shape[-1]
    if S0 is None:
        S0 = q.new_zeros(B, H, D, E)
    if z0 is None:
        z0 = q.new_zeros(B, H, D)
    out, _, S, z, _, _ = numba_linear_causal(q, k, v, float(scale), pad, S0, z0, int(chunk))
    return out, S, z
