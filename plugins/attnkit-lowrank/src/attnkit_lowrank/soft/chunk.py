"""SOFT's kernel product ``P_q (Z (P_k^T V))`` in query chunks, with its own backward (the CPU path).

``P_q = gauss(Q, K~)`` ``(L, m)`` and ``P_k = gauss(K, K~)`` ``(S, m)`` (one
matrix when q is k, the paper's form), ``Z`` the pseudo-inverse ``(m, m)``::

    W = P_k^T V,   Y = Z W,   out = P_q Y

Autograd over the plain expression wrote several whole ``(L, m)`` tensors per
call (the kernel's exponent, its ``exp``, and in the backward ``dP_q``,
``dP_k``, their sum, ``dP ∘ P``), each a fresh allocation of 128 MiB at
L = 16K, m = 256, H = 8 (page faults cost as much as the arithmetic), and
one more ``(L, m)`` pass per element-wise op. Here every ``(chunk, m)`` block
is made, exponentiated and used while it is in cache:

* forward: per chunk ``P_c = exp(x_c K~s^T + h_x + h_k)`` (one product with
  K = D, the two squared norms added in cache), ``W += P_c^T V_c``; then
  ``out_c = P_c Y``. The ``P`` blocks are kept for the second pass and the
  backward (``keep=False`` makes them again in the second pass instead);
* backward, given ``G = d out``: ``dY = sum P_c^T G_c``, ``dW = Z^T dY``,
  ``dZ = dY W^T``; per chunk ``dP_c = G_c Y^T (+ V_c dW^T`` when q is k),
  ``dS_c = dP_c ∘ P_c`` in place, ``dx_c = dS_c K~s - s·rowsum(dS_c)·x_c``,
  ``dK~ += s·dS_c^T x_c - s·colsum(dS_c)·K~``, ``dV_c = P_k,c dW``.

The exponent is ``-scale/2·|x - k~|^2 = scale·x·k~ - scale/2·|x|^2 - scale/2·|k~|^2``
as in :func:`~attnkit_lowrank.soft.module.gaussian_kernel`. Checked against
autograd through the plain expression in float64 (``tests/test_soft_chunk.py``).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from attnkit import transforms
from attnkit.caching import kept_tensors
from attnkit.first_order import first_order

from ..common import chunk_rows

#: the largest kernel-block workspace (bytes) that a thread keeps between calls with no backward (see
#: :func:`soft_kernel_product`); larger requests allocate their blocks per call as with a backward
WORKSPACE_MAX_BYTES = 256 << 20
_workspace = threading.local()


def _reused_workspace(numel: int, like: Tensor) -> Tensor | None:
    """This thread's kept flat buffer of ``like``'s dtype with at least ``numel`` elements (grown when too
    small), or None on a device other than CPU or above :data:`WORKSPACE_MAX_BYTES`."""
    if like.device.type != "cpu" or numel * like.element_size() > WORKSPACE_MAX_BYTES:
        return None
    if torch.compiler.is_exporting():
        return None   # a buffer kept across calls is no part of an exported program (it would hold a fake tensor)
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf.dtype != like.dtype or buf.numel() < numel:
        _workspace.buf = None                                             # the old one freed first
        with kept_tensors():   # written in place by later calls: never an inference tensor
            buf = _workspace.buf = torch.empty(numel, dtype=like.dtype)
    return buf[:numel]


def release_workspace() -> None:
    """Free this thread's kept kernel-block workspace (the next call with no backward allocates it again)."""
    _workspace.buf = None


def _kernel_chunks(x: Tensor, kbs_t: Tensor, hk: Tensor, scale: float, rows: int,
                   buf: Tensor | None = None) -> list[Tensor]:
    """``exp(x_c kbs_t + h_x + h_k)`` per chunk of ``rows`` rows of ``x`` ``(N, n, D)``: ``(N, c, m)`` tensors,
    fresh or (``buf``, flat, at least ``N·n·m`` elements) consecutive views of ``buf``."""
    out = []
    off, m = 0, kbs_t.shape[-1]
    for xc in x.split(rows, dim=1):
        hx = (xc * xc).sum(-1, keepdim=True).mul_(-0.5 * scale)          # (N, c, 1)
        if buf is None:
            s = torch.baddbmm(hk, xc, kbs_t)                              # h_k + x k~s^T
        else:
            n = xc.shape[0] * xc.shape[1] * m
            s = torch.baddbmm(hk, xc, kbs_t, out=buf[off:off + n].view(xc.shape[0], xc.shape[1], m))
            off += n
        out.append(s.add_(hx).exp_())
    return out


class _SoftKernelProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xq: Tensor, xk: Tensor | None, kb: Tensor, z: Tensor, v: Tensor, scale: float,
                rows: int, keep: bool, reuse: bool = False) -> Tensor:
        B, H, L, D = xq.shape
        m, E = kb.shape[2], v.shape[-1]
        N = B * H
        xq3 = xq.reshape(N, L, D)
        xk3 = None if xk is None else xk.reshape(N, -1, D)
        kb3 = kb.reshape(N, m, D)
        kbs_t = (scale * kb3).transpose(1, 2)                             # (N, D, m)
        hk = (kb3 * kb3).sum(-1).mul_(-0.5 * scale).unsqueeze(1)          # (N, 1, m)
        v3 = v.reshape(N, -1, E)
        z3 = z.reshape(N, m, m)
        w = v3.new_zeros(N, m, E)
        if keep:
            # no backward coming (reuse): the blocks go into this thread's kept workspace, not fresh memory (the
            # first touch of 128 MiB of new pages per call at 16K, m = 256, H = 8 cost ~50-80 ms, as much as the
            # kernel product's exp and scores); with q distinct from k, only P_q's blocks are kept there
            ws = _reused_workspace(N * L * m, v3) if reuse else None
            # each P_k block used for W while it is still in cache, just after its exp
            p_k, off = [], 0
            for xc, vc in zip((xq3 if xk3 is None else xk3).split(rows, dim=1), v3.split(rows, dim=1)):
                n = xc.shape[0] * xc.shape[1] * m
                pc = _kernel_chunks(xc, kbs_t, hk, scale, rows, None if ws is None else ws[off:off + n])[0]
                if ws is not None and xk3 is None:
                    off += n                                  # kept for the second pass (else: scratch)
                w.baddbmm_(pc.transpose(1, 2), vc)
                p_k.append(pc)
            p_q = p_k if xk3 is None else _kernel_chunks(xq3, kbs_t, hk, scale, rows, ws)
            y = torch.bmm(z3, w)
            # each chunk's product written into its rows of the output: no (chunk, E) temporaries and no cat
            # (those were two fresh (L, E) tensors' worth of page faults and one copy: ~15-25 ms at 16K)
            out = v3.new_zeros(N, L, E) if not p_q else v3.new_empty(N, L, E)
            r0 = 0
            for pc in p_q:
                torch.bmm(pc, y, out=out[:, r0:r0 + pc.shape[1]])
                r0 += pc.shape[1]
        else:
            # each block made twice (once per pass) rather than kept: nothing of size (L, m) in memory, but
            # slower on CPU (16K, m = 256, no grad, CPU time: 275-309 ms against 229-233 ms keeping the blocks,
            # whose first-touch page faults cost less than a second kernel product and exp)
            for xc, vc in zip((xq3 if xk3 is None else xk3).split(rows, dim=1), v3.split(rows, dim=1)):
                w.baddbmm_(_kernel_chunks(xc, kbs_t, hk, scale, rows)[0].transpose(1, 2), vc)
            y = torch.bmm(z3, w)
            out = torch.cat([torch.bmm(_kernel_chunks(xc, kbs_t, hk, scale, rows)[0], y)
                             for xc in xq3.split(rows, dim=1)], 1) if L else v3.new_zeros(N, L, E)
            p_q = p_k = []
        ctx.save_for_backward(xq3, xk3, kb3, z3, v3, w, y)
        if reuse:
            p_q = p_k = []                                    # views of the workspace: no backward uses them
        ctx.p_q, ctx.p_k = p_q, (None if xk3 is None else p_k)
        ctx.scale, ctx.rows, ctx.shape = scale, rows, (B, H, L, D, m, E)
        return out.view(B, H, L, E)

    @staticmethod
    @first_order
    def backward(ctx, grad: Tensor):
        xq3, xk3, kb3, z3, v3, w, y = ctx.saved_tensors
        p_q, p_k, scale, rows = ctx.p_q, ctx.p_k, ctx.scale, ctx.rows
        B, H, L, D, m, E = ctx.shape
        N = B * H
        shared = p_k is None
        g3 = grad.reshape(N, L, E).contiguous()      # (an expanded gradient, e.g. of .sum(), has stride 0)
        g_chunks = g3.split(rows, dim=1)
        dy = g3.new_zeros(N, m, E)
        for pc, gc in zip(p_q, g_chunks):
            dy.baddbmm_(pc.transpose(1, 2), gc)
        dw = torch.bmm(z3.transpose(1, 2), dy)                            # (N, m, E)
        dz = torch.bmm(dy, w.transpose(1, 2))                             # (N, m, m)
        kbs = scale * kb3
        dkbs = g3.new_zeros(N, m, D)                                      # sum dS^T x
        colsum = g3.new_zeros(N, 1, m)                                    # sum over rows of dS
        y_t, dw_t = y.transpose(1, 2), dw.transpose(1, 2)

        def side(x3: Tensor, ps: list[Tensor], left: list[Tensor], right_t: Tensor, extra) -> Tensor:
            """dx for one side: dP_c = left_c right_t (``extra`` appended to left when q is k), dS_c = dP_c ∘ P_c."""
            nonlocal colsum
            dx = []
            for i, (pc, xc, lc) in enumerate(zip(ps, x3.split(rows, dim=1), left)):
                # q is k: dP_c = [G_c, V_c] [Y, dW]^T, one product of depth 2E (two would write dP_c twice)
                dp = torch.bmm(lc if extra is None else torch.cat([lc, extra[i]], -1), right_t)
                ds = dp.mul_(pc)
                dkbs.baddbmm_(ds.transpose(1, 2), xc)
                colsum += ds.sum(1, keepdim=True)
                dxc = torch.bmm(ds, kbs)
                dx.append(dxc.addcmul_(ds.sum(-1, keepdim=True), xc, value=-scale))
            return torch.cat(dx, 1) if dx else x3.new_zeros(x3.shape)

        v_chunks = v3.split(rows, dim=1)
        right_q = torch.cat([y, dw], -1).transpose(1, 2) if shared else y_t
        dxq = side(xq3, p_q, list(g_chunks), right_q, list(v_chunks) if shared else None)
        dxk = None if shared else side(xk3, p_k, list(v_chunks), dw_t, None)
        pk = p_q if shared else p_k
        dv = torch.cat([torch.bmm(pc, dw) for pc in pk], 1) if pk else v3.new_zeros(v3.shape)
        dkb = dkbs.mul_(scale).sub_(kbs * colsum.transpose(1, 2))
        S = v3.shape[1]
        return (dxq.view(B, H, L, D), None if shared else dxk.view(B, H, S, D), dkb.view(B, H, m, D),
                dz.view(B, H, m, m), dv.view(B, H, S, E), None, None, None, None)


def soft_kernel_product(q: Tensor, k: Tensor, kb: Tensor, z: Tensor, v: Tensor, scale: float,
                        rows: int | None = None, keep: bool = True) -> Tensor:
    """``gauss(q, kb) @ (z @ (gauss(k, kb)^T @ v))`` in chunks of ``rows`` rows (default: ~64K scores per head).

    ``q`` ``(B, H, L, D)``, ``k`` ``(B, H, S, D)`` (the same tensor as ``q`` for the
    paper's Q = K: one kernel matrix), ``kb`` ``(B, H, m, D)``, ``z`` ``(B, H, m, m)``,
    ``v`` ``(B, H, S, E)`` -> ``(B, H, L, E)``. Differentiable in q, k, kb, z, v
    (first order). ``keep=False`` (no backward only) makes each kernel block
    twice instead of keeping them: memory O(chunk·m) instead of O(L·m), ~20%
    slower at 16K. With ``keep`` and no backward coming (no grad mode, or no
    input requiring grad) on CPU, the kept blocks are written into a flat
    workspace that the calling thread keeps for its next such call (up to
    :data:`WORKSPACE_MAX_BYTES`; 128 MiB at L = 16K, m = 256, H = 8; freed by
    :func:`release_workspace`): the same values, without the page faults of
    fresh memory every call. Calls with a backward allocate their blocks as
    before (the backward reads them).
    """
    if transforms.plain_torch():   # torch.func / torch.export: the explicit kernels, plain torch ops
        def gauss(x: Tensor) -> Tensor:
            sq = (x * x).sum(-1, keepdim=True) - 2 * x @ kb.transpose(-1, -2) + (kb * kb).sum(-1)[..., None, :]
            return torch.exp(-0.5 * scale * sq)
        return gauss(q) @ (z @ (gauss(k).transpose(-1, -2) @ v))
    m = kb.shape[2]
    rows = chunk_rows(max(q.shape[2], 1), m) if rows is None else rows
    # the backward needs the blocks: keep=False only holds where none is coming
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, kb, z, v))
    keep = keep or backward
    return _SoftKernelProduct.apply(q, None if k is q else k, kb, z, v, scale, rows, keep, keep and not backward)
