"""Shared pieces: option checks, the two iterative pseudo-inverses and segment landmarks.

The pseudo-inverses are the mechanisms' own (each paper iterates a fixed
number of times), so the module and its plain reference both call these: the
reference checks everything around them, and ``tests/test_pinv.py`` checks the
iterations themselves against :func:`torch.linalg.pinv`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import InvalidInputError, transforms
from attnkit.attention import ShortestLengths, shortest_lengths  # noqa: F401 - the core's, used by the modules
from attnkit.first_order import first_order
from attnkit.half import HALF_DTYPES, Float32Inside  # noqa: F401 - the core's mixin, used by the modules
from attnkit.transforms import assert_at_least  # noqa: F401 - the core's, used by the modules

from .kept import KeptBuffer


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (or None when allowed); else InvalidInputError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise InvalidInputError(f"{name}: expected {expected}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; else InvalidInputError naming ``name``."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name}: expected a bool, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else InvalidInputError naming ``name`` and the choices."""
    if value not in choices:
        raise InvalidInputError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def capped_count(n: int, cap: int) -> int:
    """``min(n, cap)`` for a length :func:`attnkit.transforms.symbolic` says is dynamic, as a size of its own (an
    unbacked symbol read with ``.item()``, ``1 <= count <= cap`` and ``count <= n`` asserted when the program
    runs): a backed ``min`` would fix which side the length is on (a guard ``n <= cap`` or ``n > cap``). Plain
    ``min(n, cap)`` otherwise."""
    if not transforms.symbolic(n):
        return min(n, cap)
    u = torch.scalar_tensor(n, dtype=torch.int64).clamp(max=cap).item()
    torch._check(u >= 1)
    torch._check(u <= cap)
    torch._check(u <= n)
    return u


def window_count(n: int, size: int) -> int:
    """``ceil(n / size)``: for a length :func:`attnkit.transforms.symbolic` says is dynamic
    :func:`attnkit.transforms.chunk_count` (an unbacked size), except for ``size`` 1 (``n`` itself: the count's
    asserted bounds pin it to ``n``, whose traced range starts at 2, and the program would refuse n = 1)."""
    if size == 1:
        return n
    return transforms.chunk_count(n, size) if transforms.symbolic(n) else -(-n // size)


def windows(x: Tensor, size: int) -> Tensor:
    """``x`` ``(B, H, n, C)`` zero-padded at the end to ``m·size`` positions and split into ``m = ceil(n / size)``
    windows: ``(B, H, m, size, C)``. A length ``torch.export`` traces as dynamic takes ``m`` from
    :func:`window_count` (the backed ``ceil`` would draw guards on the length) and is always padded."""
    n = x.shape[2]
    m = window_count(n, size)
    if transforms.symbolic(n) and size > 1:
        x = F.pad(x, (0, 0, 0, m * size - n))
    elif m * size != n:
        x = F.pad(x, (0, 0, 0, m * size - n))
    return x.unflatten(2, (m, size))


def window_counts(n: int, m: int, size: int, like: Tensor) -> Tensor:
    """``(m, 1)`` positions in each of the ``m`` windows of :func:`windows` over ``n`` (the last may be short),
    in ``like``'s dtype and device."""
    starts = torch.arange(m, device=like.device) * size
    return (n - starts).clamp(max=size).to(like.dtype)[:, None]


def _eye_like(a: Tensor) -> Tensor:
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


def nystrom_pinv(a: Tensor, iterations: int) -> Tensor:
    """Nystromformer's iterative pseudo-inverse of ``a`` ``(..., m, m)`` (Razavi et al. 2014).

    ``Z_0 = a^T / (|a|_1 |a|_inf)`` per matrix (the paper's code takes the two
    norms over the whole batch; per matrix keeps batch elements independent),
    then ``Z <- 1/4 Z (13 I - a Z (15 I - a Z (7 I - a Z)))`` ``iterations`` times.
    Differentiable (matrix products only).
    """
    absa = a.abs()
    norm1 = absa.sum(-2).amax(-1, keepdim=True).unsqueeze(-1)     # max column sum
    norminf = absa.sum(-1).amax(-1, keepdim=True).unsqueeze(-1)   # max row sum
    z = a.transpose(-1, -2) / (norm1 * norminf)
    eye = _eye_like(a)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def newton_pinv(a: Tensor, iterations: int) -> Tensor:
    """SOFT's Newton-Raphson Moore-Penrose iteration for ``a`` ``(..., m, m)`` (Algorithm 2 of the paper).

    ``V_0 = a^T / (|a|_1 |a|_inf)`` (below ``2 / sigma_max^2``, so the iteration
    converges to the pseudo-inverse), then ``V <- 2 V - V a V`` ``iterations`` times.
    """
    absa = a.abs()
    norm1 = absa.sum(-2).amax(-1, keepdim=True).unsqueeze(-1)
    norminf = absa.sum(-1).amax(-1, keepdim=True).unsqueeze(-1)
    z = a.transpose(-1, -2) / (norm1 * norminf)
    for _ in range(iterations):
        z = 2 * z - z @ (a @ z)
    return z


#: the converged shortcut of :func:`newton_pinv_sym` is taken where every eigenvalue's Newton error factor, and that
#: factor times 2^iterations (its derivative's), is below ``exp(-CONVERGED_EXPONENT)`` (~2e-22: under float64 rounding)
CONVERGED_EXPONENT = 50.0


def _converged_inverse(a64: Tensor, c64: Tensor, iterations: int) -> Tensor | None:
    """``a64^-1`` (float64, symmetric positive definite ``a64``) where it equals the Newton iterate to rounding.

    The iterate on an eigenvalue ``l`` is ``p_n(l) = (1 - e^(2^n)) / l`` with ``e = 1 - l^2 / c``
    (``e_{k+1} = e_k^2`` for ``e_k = 1 - l·p_k``; ``0 <= e < 1`` as ``l^2 <= |a|_2^2 <= c``). With every
    eigenvalue above ``mu = sqrt(c·r)``, ``r = (CONVERGED_EXPONENT + n·ln 2) / 2^n``, ``e^(2^n) <= (1 - r)^(2^n)
    <= exp(-r·2^n)`` and ``2^n·e^(2^n - 1)`` (in the derivatives) are below ``exp(-CONVERGED_EXPONENT)``: the
    iterate is the inverse to float64 rounding, and so is its derivative. That bound is certified by a Cholesky
    factorisation of ``a - mu' I`` succeeding for every matrix of the batch (``mu'`` = ``mu`` plus a margin of
    ``4 (m + 1) eps sqrt(c)`` for the factorisation's rounding); the inverse is then ``cholesky_inverse`` of
    ``a``'s factor. None where any matrix is not certified (the caller takes the eigendecomposition).
    """
    r = (CONVERGED_EXPONENT + iterations * math.log(2)) / 2.0 ** iterations
    if r >= 1 or a64.numel() == 0:
        return None                      # (few iterations: no eigenvalue can be converged to rounding)
    if torch.compiler.is_exporting():
        return None                      # (torch.export: no branch on the certificate; the eigendecomposition)
    m = a64.shape[-1]
    mu = c64.sqrt() * (math.sqrt(r) + 4 * (m + 1) * torch.finfo(a64.dtype).eps)           # (..., 1)
    eye = torch.eye(m, dtype=a64.dtype, device=a64.device)
    _, info = torch.linalg.cholesky_ex(a64 - mu.unsqueeze(-1) * eye)
    if bool(info.any()):
        return None
    factor, info = torch.linalg.cholesky_ex(a64)
    if bool(info.any()):
        return None
    return torch.cholesky_inverse(factor)


class _SymmetricNewtonPinv(torch.autograd.Function):
    """``newton_pinv``'s iterate of a symmetric matrix from its eigendecomposition (see :func:`newton_pinv_sym`)."""

    @staticmethod
    def forward(ctx, a: Tensor, c: Tensor, iterations: int) -> Tensor:
        work = torch.float64
        a64 = a.to(work)
        a64 = (a64 + a64.transpose(-1, -2)) / 2
        c64 = c.to(work)
        inv = _converged_inverse(a64, c64, iterations)
        ctx.iterations = iterations
        if inv is not None:
            # every eigenvalue converged: the iterate is the inverse (to rounding), from a Cholesky factor in a
            # fraction of the eigendecomposition's time (16K, m = 256, 8 heads: ~14 ms against ~55 ms)
            ctx.save_for_backward(inv)
            ctx.converged = True
            return inv.to(a.dtype)
        ctx.converged = False
        lam, u = torch.linalg.eigh(a64)
        # eigenvalues at float64 rounding level are the exact zeros of a singular A (repeated bottleneck
        # tokens): the Newton products keep such a null space exactly zero, an eigenvalue of 1e-17 would
        # grow as 2^iterations instead
        tol = lam.shape[-1] * torch.finfo(work).eps * lam.abs().amax(-1, keepdim=True)
        lam = torch.where(lam.abs() <= tol, torch.zeros_like(lam), lam)
        p = lam / c64
        for _ in range(iterations):
            p = 2 * p - lam * p * p
        ctx.save_for_backward(lam, u, c64)
        return ((u * p.unsqueeze(-2)) @ u.transpose(-1, -2)).to(a.dtype)

    @staticmethod
    @first_order
    def backward(ctx, grad: Tensor):
        if ctx.converged:
            # p(l) = 1/l to rounding, its divided differences -1/(l_i l_j): d(a^-1) = -a^-1 da a^-1; the scaling
            # c no longer enters (its derivative is below exp(-CONVERGED_EXPONENT) relative, see _converged_inverse)
            inv, = ctx.saved_tensors
            g = grad.to(inv.dtype)
            grad_a = -(inv @ ((g + g.transpose(-1, -2)) / 2) @ inv)
            return grad_a.to(grad.dtype), grad.new_zeros(inv.shape[:-2] + (1,)), None
        lam, u, c = ctx.saved_tensors
        g = grad.to(lam.dtype)
        gs = u.transpose(-1, -2) @ ((g + g.transpose(-1, -2)) / 2) @ u
        # Daleckii-Krein: d p(A) = U (P ∘ (U^T dA U)) U^T with P_ij the divided difference p[l_i, l_j]
        # (p'(l_i) on the diagonal). For well-separated eigenvalues it is the quotient (p_i - p_j) / (l_i - l_j);
        # for equal or close ones (relative gap <= 1e-3, the quotient would cancel) it is carried through the
        # iteration p <- 2p - l p^2 exactly: p'[a, b] = 2 p[a, b] - p(a)^2 - b p[a, b] (p(a) + p(b)), whose
        # error factor 2 - b (p(a) + p(b)) stays below 2 in size for such pairs (for distant ones it does not:
        # hence the quotient there). ``dp_dc`` is each p(l_i)'s derivative in the scaling c (p_0 = l / c).
        li, lj = lam.unsqueeze(-1), lam.unsqueeze(-2)
        gap = li - lj
        close = gap.abs() <= 1e-3 * torch.maximum(li.abs(), lj.abs())
        # the close pairs (the diagonal and near-equal eigenvalues, few) carried through the iteration as
        # vectors; every other pair is the quotient of the final p, formed once (the whole (m, m) recursion
        # every iteration cost ~10 (m, m) passes per iteration: ~300 ms of SOFT's 16K backward at m = 256)
        at = close.nonzero(as_tuple=True)
        batch, ia, ib = at[:-2], at[-2], at[-1]
        lb = lam[(*batch, ib)]
        p = lam / c
        dp_dc = -lam / (c * c)
        div_close = 1 / c[(*batch, torch.zeros_like(ia))]
        for _ in range(ctx.iterations):
            pa, pb = p[(*batch, ia)], p[(*batch, ib)]
            div_close = 2 * div_close - pa * pa - lb * div_close * (pa + pb)
            dp_dc = 2 * dp_dc * (1 - lam * p)
            p = 2 * p - lam * p * p
        safe_gap = torch.where(close, torch.ones_like(gap), gap)
        div = (p.unsqueeze(-1) - p.unsqueeze(-2)) / safe_gap
        div[at] = div_close
        grad_a = u @ (div * gs) @ u.transpose(-1, -2)
        grad_c = (dp_dc * gs.diagonal(dim1=-2, dim2=-1)).sum(-1, keepdim=True)
        return grad_a.to(grad.dtype), grad_c.to(grad.dtype), None


def newton_pinv_sym(a: Tensor, iterations: int) -> Tensor:
    """:func:`newton_pinv` of a symmetric ``a`` ``(..., m, m)``, through one eigendecomposition.

    Every Newton iterate is a polynomial in ``a`` (``V_0 = a / c`` with
    ``c = |a|_1 |a|_inf``, ``V <- 2V - V a V``), so with ``a = U diag(l) U^T``
    the result is ``U diag(p(l)) U^T`` where the scalar ``p`` follows the same
    iteration on each eigenvalue: the same function of ``a`` as
    :func:`newton_pinv` (equal to rounding in float64), for one ``eigh``
    instead of ``2·iterations`` ``m x m`` products. The eigendecomposition and
    the scalar iteration run in float64 whatever the input's dtype (in float32
    this is more accurate than the float32 Newton products; float32 ``eigh``
    alone is not), and the result comes back in ``a``'s dtype. The backward is
    the exact derivative of that function (Daleckii-Krein, with the divided
    differences carried through the iteration, so equal eigenvalues are no
    special case), gradients reach ``a`` through ``c`` as well. ``a`` is taken
    as ``(a + a^T) / 2``; the gradient is that of this symmetrised function.
    Eigenvalues within float64 rounding of zero (``m·eps·max|l|``) count as
    exact zeros, as the products treat the null space of a singular ``a``
    (repeated rows); on CPU this is SOFT's path (:class:`~attnkit_lowrank.soft.module.SoftAttention`).
    Where every eigenvalue has converged to float64 rounding (certified per
    call by a Cholesky factorisation of ``a - mu I``, see :func:`_converged_inverse`:
    with 20 iterations, each eigenvalue above ~0.008 sqrt(c)), the function is
    ``a^-1`` and comes from ``a``'s Cholesky factor instead of the
    eigendecomposition, with the derivative ``-a^-1 da a^-1``; otherwise (an
    ill-conditioned or singular ``a``, few iterations) the eigendecomposition.
    """
    if transforms.plain_torch():   # torch.func / torch.export: the product iteration, the same to rounding
        return newton_pinv((a + a.transpose(-1, -2)) / 2, iterations)
    absa = a.abs()
    c = absa.sum(-2).amax(-1, keepdim=True) * absa.sum(-1).amax(-1, keepdim=True)     # (..., 1)
    return _SymmetricNewtonPinv.apply(a, c, iterations)


def segment_weights(keep: Tensor | None, batch: int, n: int, m: int, dtype: torch.dtype,
                    device: torch.device) -> Tensor:
    """Averaging weights ``(B, 1, m, n)`` of ``m`` segment-mean landmarks over the kept tokens.

    Row b with ``c`` kept tokens (``keep`` bool ``(B, n)``, None = all kept)
    numbers them ``r = 0..c-1`` in order; landmark ``j`` is the mean of the
    kept tokens with ``floor(j·c/m) <= r < floor((j+1)·c/m)``, or of the one
    token ``r = floor(j·c/m)`` when that range is empty (``c < m``: landmarks
    repeat). A row with no kept token has all-zero weights. Padded tokens get
    weight 0, so they never enter a landmark.
    """
    if keep is None:
        keep = torch.ones(batch, n, dtype=torch.bool, device=device)
    c = keep.sum(-1, keepdim=True)                                     # (B, 1)
    rank = keep.long().cumsum(-1) - 1                                  # (B, n)
    j = torch.arange(m, device=device)
    lo = torch.div(j[None, :] * c, m, rounding_mode="floor")           # (B, m)
    hi = torch.maximum(torch.div((j[None, :] + 1) * c, m, rounding_mode="floor"), lo + 1)
    inside = keep[:, None, :] & (rank[:, None, :] >= lo[:, :, None]) & (rank[:, None, :] < hi[:, :, None])
    w = inside.to(dtype) / (hi - lo).to(dtype)[:, :, None]
    return w[:, None]


#: elements of one query chunk's (chunk, m) score block per head: small enough to stay in cache
CHUNK_ELEMENTS = 1 << 16


def chunk_rows(L: int, m: int) -> int:
    """Queries per chunk for ``m`` columns: about CHUNK_ELEMENTS scores per head, between 64 and L."""
    return max(64, min(L, CHUNK_ELEMENTS // max(m, 1)))


def heads_inner(batch: tuple[int, ...], rows: int, cols: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty ``(*batch, rows, cols)`` tensor; for ``batch = (B, H)`` laid out in memory as ``(B, rows, H, cols)``.

    What a multi-head layer does next with an attention output ``(B, H, L, E)`` is the
    head merge ``o.transpose(1, 2).reshape(B, L, H·E)``: a view of this layout, a copy of
    a contiguous one (32 MiB per call at L = 16K, H·E = 512). Chunks of rows are written
    into it with ``torch.matmul(..., out=chunk)`` (a row-major block with leading
    dimension H·cols: no copy).
    """
    if len(batch) != 2:
        return like.new_empty((*batch, rows, cols), dtype=dtype)
    B, H = batch
    return like.new_empty((B, rows, H, cols), dtype=dtype).transpose(1, 2)


def grad_like(x: Tensor, batch: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An empty gradient buffer ``(*batch, *x.shape[-2:])`` in ``x``'s memory layout when ``x`` has that shape.

    ``x`` a head view ``(B, H, L, D)`` of a ``(B, L, H·D)`` tensor: its gradient in the
    same layout makes the view's backward (the head split's) a view, not a copy.
    """
    if tuple(x.shape[:-2]) == tuple(batch):
        return torch.empty_like(x, dtype=dtype)          # preserve_format: x's strides where x is dense
    return heads_inner(batch, x.shape[-2], x.shape[-1], x, dtype)


def _chunks(x: Tensor, rows: int) -> list[Tensor]:
    return list(x.split(rows, dim=-2))


class Scratch:
    """Flat memory that the chunks of one call reuse: ``scratch(shape)`` is a contiguous ``shape`` view of it.

    A fresh block per chunk (the allocator's, then freed) cost 5-10% of a chunk's product and softmax.
    """

    __slots__ = ("buf",)

    def __init__(self, numel: int, like: Tensor, dtype: torch.dtype) -> None:
        self.buf = like.new_empty(numel, dtype=dtype)

    def __call__(self, shape: tuple[int, ...]) -> Tensor:
        return self.buf[:math.prod(shape)].view(shape)


def _attend_chunks(q: Tensor, kt: Tensor, v: Tensor, rows: int,
                   keep: bool) -> tuple[Tensor, tuple[list[Tensor], KeptBuffer | None]]:
    """``softmax(q kt) v`` chunk by chunk into a :func:`heads_inner` output; with ``keep`` also the probability
    blocks, in a :class:`~attnkit_lowrank.kept.KeptBuffer` (returned with them: they live as long as it)."""
    batch = torch.broadcast_shapes(q.shape[:-2], kt.shape[:-2], v.shape[:-2])
    L, m = q.shape[-2], kt.shape[-1]
    out = heads_inner(batch, L, v.shape[-1], q, torch.promote_types(q.dtype, v.dtype))
    s_dtype = torch.promote_types(q.dtype, kt.dtype)
    block = math.prod(batch) * min(rows, L) * m
    scores = Scratch(block, q, s_dtype)
    ps = []
    if keep:
        # the blocks the backward reads go into a pooled buffer (reused from call to call: no fresh pages)
        kept, probs = KeptBuffer(math.prod(batch) * L * m, s_dtype, q.device), None
    else:
        kept, probs = None, Scratch(block, q, s_dtype)
    for qc, oc in zip(_chunks(q, rows), _chunks(out, rows)):
        shape = (*batch, qc.shape[-2], m)
        s = torch.matmul(qc, kt, out=scores(shape))
        p = torch.ops.aten._softmax.out(s, -1, False, out=kept.next(shape) if keep else probs(shape))
        if keep:
            ps.append(p)
        torch.matmul(p, v, out=oc)
    return out, (ps, kept)


class _SoftmaxAttend(torch.autograd.Function):
    """``softmax(q @ kt) @ v`` in query chunks of ``rows`` rows, with its backward written out per chunk.

    Autograd through the chunks ran, per chunk, a softmax backward into a fresh block, accumulated the
    gradients of ``kt`` and ``v`` one node at a time and, for head views of a (B, L, H·D) tensor, took a
    per-head fallback (select, clone, mm) in the products' backward. Here, per chunk of ``dO``:
    ``dS = P ∘ (dO vᵀ - rowsum(dO ∘ O))`` in place (``rowsum(P ∘ dP)`` read off the output: an
    (chunk, E) pass, not (chunk, m)), ``dq_c = dS ktᵀ`` written straight into a ``dq`` laid out as ``q``
    (:func:`grad_like`: no concatenation, and the head split's backward is a view), ``dkt += q_cᵀ dS``,
    ``dv += P_cᵀ dO_c``. An output gradient with zero strides (an expanded one, e.g. of ``.sum()``) is made
    contiguous chunk by chunk, in cache.
    """

    @staticmethod
    def forward(ctx, q: Tensor, kt: Tensor, v: Tensor, rows: int) -> Tensor:
        out, (ps, kept) = _attend_chunks(q, kt, v, rows, keep=True)
        ctx.save_for_backward(q, kt, v, out)
        ctx.ps, ctx.kept, ctx.rows = ps, kept, rows
        return out

    @staticmethod
    @first_order
    def backward(ctx, d_out: Tensor):
        q, kt, v, out = ctx.saved_tensors
        ps, rows = ctx.ps, ctx.rows
        need_q, need_kt, need_v = ctx.needs_input_grad[:3]
        v_t, k = v.transpose(-1, -2), kt.transpose(-1, -2)
        dkt = dv = None
        dq = grad_like(q, out.shape[:-2], out.dtype) if need_q else None
        dqs = _chunks(dq, rows) if need_q else [None] * len(ps)
        scratch = Scratch(ps[0].numel(), ps[0], ps[0].dtype) if ps else None
        for p, qc, dc, oc, dqc in zip(ps, _chunks(q, rows), _chunks(d_out, rows), _chunks(out, rows), dqs):
            if 0 in dc.stride():
                dc = dc.contiguous()            # an expanded gradient (e.g. of .sum()): stride 0
            if need_v:
                dvc = p.transpose(-1, -2) @ dc
                dv = dvc if dv is None else dv.add_(dvc)
            if not (need_q or need_kt):
                continue
            ds = torch.matmul(dc, v_t, out=scratch(p.shape)).sub_((dc * oc).sum(-1, keepdim=True)).mul_(p)
            if need_q:
                torch.matmul(ds, k, out=dqc)
            if need_kt:
                dktc = qc.transpose(-1, -2) @ ds
                dkt = dktc if dkt is None else dkt.add_(dktc)
        if dq is not None and dq.shape != q.shape:
            dq = dq.sum_to_size(q.shape)
        if dkt is not None and dkt.shape != kt.shape:
            dkt = dkt.sum_to_size(kt.shape)
        if dv is not None and dv.shape != v.shape:
            dv = dv.sum_to_size(v.shape)
        return dq, dkt, dv, None


def softmax_attend(q: Tensor, kt: Tensor, v: Tensor) -> Tensor:
    """``softmax(q @ kt) @ v``: q ``(B, H, L, D)``, kt ``(..., D, m)``, v ``(..., m, E)`` -> ``(B, H, L, E)``.

    Query chunks of ``chunk_rows(L, m)`` rows: each ``(chunk, m)`` score block is
    computed, normalised and used while it is still in cache (the whole
    ``(L, m)`` block written and read three times ran at half the speed: 16K
    queries x 256 columns x 8 heads, one thread, 338 -> 164 ms), and its product
    with ``v`` written in place into the output, which is laid out as
    ``(B, L, H, E)`` (:func:`heads_inner`: the head merge that follows is a view).
    Same values; the backward is :class:`_SoftmaxAttend`'s, per chunk (first order).
    """
    L, m = q.shape[-2], kt.shape[-1]
    if not L or transforms.plain_torch():   # torch.func / torch.export: plain torch ops (no out=, no Function)
        return torch.softmax(q @ kt, -1) @ v
    c = chunk_rows(L, m)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, kt, v)):
        return _SoftmaxAttend.apply(q, kt, v, c)
    # no backward: each block is dropped once used (the function above keeps them all for its backward)
    return _attend_chunks(q, kt, v, c, keep=False)[0]
