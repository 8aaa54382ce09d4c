"""The one custom-operator wrapper of the kernels, and the one backward of linear attention.

Every numba and triton kernel is a ``torch.library`` custom operator in the
``attnkit_kernelized`` namespace (:func:`define`): a fake (meta) function
gives ``torch.compile`` the output shapes, so a model using the kernels
traces without graph breaks; differentiable operators register their
backward with ``register_autograd``, written with other custom operators so
the backward traces too.

Linear attention (``linear``, ``performer``, ungated ``rfa``) has one
backward for every kernel backend, :func:`linear_attention_backward`: three
more *products* of the backend (see :func:`define_linear_attention`).

``torch.func`` transforms (``grad``, ``vmap``, ...) cannot see inside a custom
operator; :func:`runnable_backend` sends their calls to the torch path.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from attnkit.first_order import first_order

from ._busy import busy_threads
from .common import with_ones_column

NAMESPACE = "attnkit_kernelized"

#: Signature of a backend's product primitive (see :func:`define_linear_attention`).
Product = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]


#: the half-precision dtypes the modules take (computed in float32, the triton kernels reading half inputs)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def kernel_inputs(backend: str, phi_q: Tensor, phi_k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Features and values as ``backend``'s operator takes them on a half-precision module call.

    The modules compute features in float32 for half inputs and leave ``v`` in its half dtype only when the
    call runs on ``triton`` (see :meth:`KernelizedAttention._attend`): ``triton`` then gets the features in
    ``v``'s dtype (half inputs, float32 accumulators and states; the gradients come back in float32 through the
    casts); any other backend (also a ``torch.func`` fallback from triton) gets ``v`` upcast to float32. Inputs
    that are not half pass unchanged.
    """
    if v.dtype in HALF_DTYPES:
        if backend == "triton":
            return phi_q.to(v.dtype), phi_k.to(v.dtype), v
        v = v.float()
    return phi_q, phi_k, v


def acc_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 when any of ``tensors`` is float64, else float32: the dtype kernels accumulate in and return
    numerators, denominators and states in (half-precision inputs keep float32 states)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def define(name: str, fn: Callable[..., Any], fake: Callable[..., Any], *,
           backward: Callable[..., Any] | None = None, setup_context: Callable[..., Any] | None = None) -> Any:
    """Register ``fn`` as the custom operator ``attnkit_kernelized::name`` (schema from its annotations).

    Args:
        fn: the implementation; returns new tensors (never its inputs or views of them).
        fake: same signature, returns empty tensors of the output shapes (for tracing).
        backward, setup_context: the autograd formula (``register_autograd``); None: not differentiable.
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
    op.register_fake(fake)
    if backward is not None:   # the kernels' backward is first order: second derivatives through it refuse
        op.register_autograd(first_order(backward), setup_context=setup_context)
    return op


def runnable_backend(backend: str, *tensors: Tensor | None) -> str:
    """``backend``, or ``"torch"`` when a ``torch.func`` transform wraps one of ``tensors``.

    A custom operator has no ``torch.func`` rules; the chunked torch form
    computes the same result with plain torch operations, which every
    transform supports.
    """
    if backend == "torch" or torch.compiler.is_compiling():
        return backend
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(t is not None and wrapped(t) for t in tensors):
        return "torch"
    return backend


def backend_module(mechanism: str, backend: str) -> ModuleType:
    """``attnkit_kernelized.<mechanism>.<chunk | numba_ops | triton_ops>``, imported on first use.

    Plain import statements (not ``importlib``): ``torch.compile`` runs them
    while tracing, so even a first call inside a compiled model has no graph break.
    """
    if mechanism == "linear":
        if backend == "numba":
            from .linear import numba_ops as mod
        elif backend == "triton":
            from .linear import triton_ops as mod
        else:
            from .linear import chunk as mod
    elif mechanism == "rfa":
        if backend == "numba":
            from .rfa import numba_ops as mod
        elif backend == "triton":
            from .rfa import triton_ops as mod
        else:
            from .rfa import chunk as mod
    elif backend == "numba":
        from .fast_weight import numba_ops as mod
    elif backend == "triton":
        from .fast_weight import triton_ops as mod
    else:
        from .fast_weight import chunk as mod
    return mod


# ---------------------------------------------------------------- linear attention
def _seq(x: Tensor) -> Tensor:
    """``(B, H, L, F)`` -> contiguous ``(B*H, L, F)`` (an ``(N, L, F)`` one stays as it is)."""
    if x.dim() == 3:
        return x.contiguous()
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def linear_attention_backward(product: Product, ctx: Any, g_out: Tensor | None, g_den: Tensor | None,
                              g_S: Tensor | None, g_z: Tensor | None, prep: Callable[..., Any] | None = None
                              ) -> tuple[Tensor | None, ...]:
    """Gradients of normalised linear attention from three products, with no stored prefix states.

    The forward pass is ``num'_t = x_t^T (S'_0 + sum_{j in J(t)} y_j w'_j^T)`` with
    ``x = phi(q)``, ``y = phi(k)``, ``w' = [v, 1]`` and ``S'_0 = [S_0, z_0]``
    (``num' = [num, den]``), ``out = num / den`` (0 where ``den = 0``) and the
    final state ``S'_L = S'_0 + sum_j y_j w'_j^T``; ``J(t)`` is ``j <= t`` (causal)
    or every key. With ``g' = [d num, d den]`` and ``G = [d S_L, d z_L]``::

        d phi(q)_t = product(g', w', phi(k), state=S'_0^T)_t           # S'_t g'_t
        d phi(k)_j = product(w', g', phi(q), state=G^T, reversed)_j    # G w'_j + sum_{t: j in J(t)} (w'_j . g'_t) x_t
        d v_j      = product(phi(k), phi(q), d num, state=d S_L, reversed)_j
        d S'_0     = the final state of the second product (transposed)

    Args:
        product: the backend's product primitive
            ``(x, y, w, S0, z0, mode, chunk, with_den, normalize) -> (out, den, S, z)``.
        ctx: saved ``(phi_q, phi_k, v, S0, z0, out, den)``, ``ctx.causal``, ``ctx.chunk``.
        g_out, g_den, g_S, g_z: gradients of the outputs (None when unused).
        prep: the backend's ``(g_out, out, den, v) -> (g', w', d num)`` on ``(N, L, .)`` sequences in one pass
            (``numba_linear_backward_inputs``), or None: torch operations (also when ``g_den`` is given).
    """
    # contiguous first: cat and elementwise ops on transposed inputs (a multi-head layer's q, k, v) may
    # give strides that differ between tracing (fake tensors) and running, and the reshapes below
    # would then be traced as views that do not apply at run time
    phi_q, phi_k, v, S0, z0, out, den = (t.contiguous() for t in ctx.saved_tensors)
    grads = backward_products(product, phi_q, phi_k, v, S0, z0, out, den, ctx.needs_input_grad[:5], ctx.causal,
                              ctx.chunk, g_out, g_den, g_S, g_z, prep)
    return (*grads, None, None)


def backward_products(product: Product, phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor, z0: Tensor,
                      out: Tensor, den: Tensor, needs: Any, causal: bool, chunk: int, g_out: Tensor | None,
                      g_den: Tensor | None, g_S: Tensor | None, g_z: Tensor | None,
                      prep: Callable[..., Any] | None = None, dq_of: Callable[..., Tensor] | None = None,
                      dk_of: Callable[..., tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor | None, ...]:
    """:func:`linear_attention_backward` on tensors: ``(d phi_q, d phi_k, dv, dS0, dz0)`` (None where ``needs``,
    five flags, says no). ``dq_of(g', w', S'_0^T, z)`` and ``dk_of(w', g', G^T, z)`` (``(N, L, .)`` sequences)
    replace the first two products (``dk_of`` returns the gradient and the final state): the performer's training
    operator runs its features' backward on their blocks there (:mod:`.performer.numba_train`), and the first
    two results are then the gradients of whatever those functions differentiate (``(B, H, L, .)``)."""
    g_out = None if g_out is None else g_out.contiguous()
    need_q, need_k, need_v, need_S0, need_z0 = needs
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    N = B * H
    fwd, rev = ("causal", "reverse") if causal else ("full", "full")
    if prep is not None and g_den is None and v.shape[2] == L:
        gp, vp, g_num = prep(None if g_out is None else _seq(g_out), _seq(out), den.reshape(N, L), _seq(v))
    else:
        empty = den == 0
        inv = torch.where(empty, torch.zeros_like(den), 1 / torch.where(empty, torch.ones_like(den), den))
        g_out = torch.zeros_like(out) if g_out is None else g_out
        g_num = g_out * inv.unsqueeze(-1)
        g_d = -(g_out * out).sum(-1) * inv
        if g_den is not None:
            g_d = g_d + g_den
        gp = torch.cat([g_num, g_d.unsqueeze(-1)], dim=-1)                   # (B, H, L, E+1)
        vp = with_ones_column(v)                                              # (B, H, S, E+1)
    gp, vp = _seq(gp), _seq(vp)
    G_S = torch.zeros_like(S0) if g_S is None else g_S
    G_z = torch.zeros_like(z0) if g_z is None else g_z
    no_z = phi_q.new_zeros(N, E + 1)
    dq = dk = dv = dS0 = dz0 = None
    if need_q:
        Sp0T = torch.cat([S0, z0.unsqueeze(-1)], dim=-1).transpose(-1, -2).reshape(N, E + 1, M).contiguous()
        if dq_of is None:
            dq = product(gp, vp, _seq(phi_k), Sp0T, no_z, fwd, chunk, False, False)[0]
        else:
            dq = dq_of(gp, vp, Sp0T, no_z)
        dq = dq.view(B, H, L, dq.shape[-1])
    if need_k or need_S0 or need_z0:
        GT = torch.cat([G_S, G_z.unsqueeze(-1)], dim=-1).transpose(-1, -2).reshape(N, E + 1, M).contiguous()
        if dk_of is None:
            dk_, _, dSpT, _ = product(vp, gp, _seq(phi_q), GT, no_z, rev, chunk, False, False)
        else:
            dk_, dSpT = dk_of(vp, gp, GT, no_z)
        dk = dk_.view(B, H, phi_k.shape[2], dk_.shape[-1])
        dSp0 = dSpT.view(B, H, E + 1, M).transpose(-1, -2)
        dS0, dz0 = dSp0[..., :E].contiguous(), dSp0[..., E].contiguous()
    if need_v:
        dv = product(_seq(phi_k), _seq(phi_q), _seq(g_num), G_S.reshape(N, M, E).contiguous(),
                     phi_q.new_zeros(N, M), rev, chunk, False, False)[0].view(v.shape)
    # in the inputs' dtypes (the products return float32 for half-precision inputs; no-ops otherwise)
    return tuple(None if g is None else g.to(t.dtype) for g, t in
                 zip((dq, dk, dv, dS0, dz0), (phi_q, phi_k, v, S0, z0), strict=True))


def define_linear_attention(backend: str, product: Product, prep: Callable[..., Any] | None = None) -> Any:
    """Register ``attnkit_kernelized::<backend>_linear_attention`` on the backend's product primitive.

    The product primitive computes, for ``x (N, L, DX)``, ``y (N, S, DX)``,
    ``w (N, S, DW)`` and a state ``S0 (N, DX, DW)``, ``z0 (N, DX)``::

        out_t = x_t^T (S0 + sum_{j in J(t)} y_j w_j^T),   den_t = x_t . (z0 + sum_{j in J(t)} y_j)

    with ``J(t)`` = ``j <= t`` (``mode="causal"``), ``j >= t`` (``"reverse"``) or
    every j (``"full"``), ``out / den`` when ``normalize``, and returns the
    final state ``(S0 + sum_j y_j w_j^T, z0 + sum_j y_j)``.

    The operator: ``(phi_q (B, H, L, M), phi_k (B, H, S, M), v (B, H, S, E),
    S0 (B, H, M, E), z0 (B, H, M), causal, chunk) -> (out (B, H, L, E),
    den (B, H, L), S (B, H, M, E), z (B, H, M))``, ``out`` normalised (0 where
    ``den == 0``), differentiable in every tensor input. ``prep``: the backend's one-pass backward inputs (see
    :func:`linear_attention_backward`), or None.
    """

    def fn(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor, z0: Tensor, causal: bool,
           chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        out, den, S, z = product(_seq(phi_q), _seq(phi_k), _seq(v), S0.reshape(N, M, E).contiguous(),
                                 z0.reshape(N, M).contiguous(), "causal" if causal else "full", chunk, True, True)
        return out.view(B, H, L, E), den.view(B, H, L), S.view(B, H, M, E), z.view(B, H, M)

    def fake(phi_q, phi_k, v, S0, z0, causal, chunk):
        B, H, L, M = phi_q.shape
        acc = acc_dtype(phi_q, phi_k, v, S0, z0)
        return (v.new_empty(B, H, L, v.shape[-1], dtype=acc), v.new_empty(B, H, L, dtype=acc),
                S0.new_empty(S0.shape, dtype=acc), z0.new_empty(z0.shape, dtype=acc))

    def setup_context(ctx, inputs, output):
        phi_q, phi_k, v, S0, z0, causal, chunk = inputs
        out, den, _, _ = output
        ctx.save_for_backward(phi_q, phi_k, v, S0, z0, out, den)
        ctx.causal, ctx.chunk = causal, chunk
        ctx.device = phi_q.device        # not read back from ctx.saved_tensors: checkpointing allows one unpack
        ctx.set_materialize_grads(False)

    def backward(ctx, g_out, g_den, g_S, g_z):
        with busy_threads(ctx.device):       # see ._busy: one torch thread on a busy machine
            return linear_attention_backward(product, ctx, g_out, g_den, g_S, g_z, prep)

    return define(f"{backend}_linear_attention", fn, fake, backward=backward, setup_context=setup_context)


def call_linear_attention(op: Any, phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor | None, z0: Tensor | None,
                          *, causal: bool, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Run a :func:`define_linear_attention` operator with zero states for None; ``(out, S, z)``, ``out`` in
    the dtype of ``v``, the states float32 for half-precision inputs (float64 for float64)."""
    B, H, _, M = phi_q.shape
    acc = acc_dtype(phi_q, v)
    if S0 is None:
        S0 = phi_q.new_zeros(B, H, M, v.shape[-1], dtype=acc)
    if z0 is None:
        z0 = phi_q.new_zeros(B, H, M, dtype=acc)
    out, _, S, z = op(phi_q, phi_k, v, S0, z0, causal, chunk)
    return out.to(v.dtype), S, z
