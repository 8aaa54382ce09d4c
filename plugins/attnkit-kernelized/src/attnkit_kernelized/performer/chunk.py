"""Causal FAVOR+ with exponents kept in log space and a prefix-safe per-feature maximum (the ``torch`` form).

The random features are ``phi_q_tm = a_tm exp(lq_tm)`` and
``phi_k_jm = b_jm exp(lk_jm)`` (``a = b = 1`` for the positive map, the sine
and cosine values for the trig map, whose exponent ``lk_j = |k_j|^2/2`` is the
same for every feature: ``lk`` then has one column). Causal attention is
``out_t = sum_{j <= t} A_tj v_j / sum_{j <= t} A_tj`` with
``A_tj = sum_m phi_q_tm phi_k_jm``.

For inputs of large norm the exponents span thousands, so neither factor can
be formed on its own in floating point (every feature of a row underflows:
the all-zero rows of the unstabilised map). Every exponent is shifted by
references that cancel between numerator and denominator:

* ``mk_tm = max_{j <= t} lk_jm``: the running (prefix) maximum of each
  feature's key exponent, ``(B, H, L, M)`` (``(B, H, L, 1)`` for trig); it
  uses keys up to ``t`` only, so no future key can change (or underflow) an
  earlier output.
* ``c_t = max_m (lq_tm + mk_tm)``: the query's shift. Then every weight
  ``exp(lq_tm + lk_jm - c_t) <= 1`` for ``j <= t``, and the feature attaining
  ``c_t`` has a key with weight exactly 1 (its own maximum): the denominator
  of the positive map is >= 1 for every query that sees a key, at any scale.

Chunked form (``C`` positions per chunk, the state carried across chunks by
matrix products): the state ``S`` (``M x (E+1)``, the denominator a column
of ones appended to ``v``) is held relative to ``R = mk`` at the end of the
previous chunk: ``S = sum_j exp(lk_j - R) [v_j, 1]``, entries <= 1 per key.

* across chunks: ``out_t += (a_t exp(lq_t + R - c_t)) S`` (exponent <= 0);
  ``S <- exp(R - R') S + (b exp(lk - R'))^T [v, 1]`` with ``R'`` the
  maximum at the chunk's end (every exponent <= 0);
* inside a chunk: ``A = (a exp(lq + r - c)) (b exp(lk - r))^T`` masked to
  ``j <= t``, with ``r = mk`` at the chunk's *first* position (seen by every
  query of the chunk, so prefix-safe). A key of the chunk may exceed ``r``
  by ``g``: its factor is then up to ``e^g``. When ``g`` exceeds
  :data:`GROWTH_LIMIT` for a chunk (sharp growth of the maximum inside it,
  e.g. at the start of a sequence of large-norm keys) that chunk's
  ``(C x C)`` block is computed pairwise instead,
  ``A_tj = sum_m a_tm b_jm exp(lq_tm + lk_jm - c_t)`` (every exponent <= 0),
  so no factor overflows or underflows spuriously.

The shifts are detached: they are constants that cancel (the function and
its gradients are those of the unshifted formula). Padded keys write
nothing and never enter a maximum. ``chunk=1`` is the recurrent step form
(one position at a time, the growth inside a chunk is then always 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import transforms

from ..common import DEFAULT_CHUNK, chunk_outputs, group_chunk_count, normalize, pad_length, with_ones_column

#: largest growth (in the exponent) of a feature's key maximum inside one chunk for the factored
#: (matrix-product) form; beyond it the chunk's block is computed pairwise (per dtype)
GROWTH_LIMIT = {torch.float32: 20.0, torch.float64: 200.0}

#: the reference of a state that has seen no key (finite, so differences stay finite; exp() of it is 0)
NO_KEY = -1e30


def _chunks(x: Tensor, C: int, N: int, fill: float, always: bool = False) -> Tensor:
    """``(B, H, L, F)`` -> ``(B, H, N, C, F)``, the tail padded with ``fill`` (``always``: even by 0, no branch
    on a symbolic size)."""
    extra = N * C - x.shape[2]
    if always or extra:
        x = pad_length(x, extra, fill)
    return x.reshape(*x.shape[:2], N, C, x.shape[-1])


def _references(lk_c: Tensor, m0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """References per chunk of ``lk_c (B, H, N, C, Mk)`` from the state's ``m0 (B, H, Mk)``, all from keys up to
    the chunk's first position or its end (prefix-safe), each ``(B, H, N, 1, Mk)``: ``end`` the running maximum
    through the chunk's last key (R'), ``prev`` the one before (R), ``first`` = max(prev, the chunk's first key).
    """
    end = torch.maximum(torch.cummax(lk_c.amax(3), dim=2).values, m0.unsqueeze(2)).unsqueeze(3)
    prev = torch.cat([m0[:, :, None, None], end], dim=2)[:, :, :end.shape[2]]
    return end, prev, torch.maximum(prev, lk_c[:, :, :, :1])


def _pairwise(lq: Tensor, lk: Tensor, c: Tensor, a: Tensor | None, b: Tensor | None, future: Tensor) -> Tensor:
    """``A_tj = sum_m a_tm b_jm exp(lq_tm + lk_jm - c_t)`` for ``j <= t`` (0 above), ``(..., C, C)``;
    every exponent <= 0 (``c_t`` includes the maximum over keys up to ``t``)."""
    expo = lq[..., :, None, :] + lk[..., None, :, :] - c[..., :, None, :]          # (..., C, C, M)
    w = torch.exp(expo.masked_fill(future[..., None], float("-inf")))
    if a is not None:
        w = w * a[..., :, None, :]
    if b is not None:
        w = w * b[..., None, :, :]
    return w.sum(-1)


def _prefix_max(x: Tensor) -> Tensor:
    """The running maximum of ``x (..., C, M)`` along ``C`` by doubling (log2 C maxima of shifted copies): what
    ``torch.cummax(x, dim=-2).values`` gives, for a program whose leading size is unbacked (the marked chunks'
    count), where ``cummax`` does not trace."""
    C, step = x.shape[-2], 1
    while step < C:
        x = torch.cat([x[..., :step, :], torch.maximum(x[..., step:, :], x[..., :-step, :])], dim=-2)
        step *= 2
    return x


def _pairwise_chunks(A: Tensor, q_inter: Tensor, pairwise: Tensor, lq: Tensor, lk: Tensor, prev: Tensor,
                     a: Tensor | None, b: Tensor | None, future: Tensor) -> tuple[Tensor, Tensor]:
    """``(A, q_inter)`` with the chunks ``pairwise`` marks recomputed in the per-position shift
    ``c'_t = max_m (lq_tm + max(prev_m, max_{j <= t} lk_jm)) >= c_t``: their block pairwise (every exponent
    <= 0) and their across-chunk query factors multiplied by ``exp(c_t - c'_t) <= 1``, so numerator and
    denominator of each row keep one shift. Under ``torch.compile``: every chunk, selected (no data-dependent
    branch), and so under torch.func transforms (vmap cannot select by the data). In a program
    (``torch.export``) the marked chunks are selected (a count of its own, unbacked; none selected: nothing is
    recomputed), their running key maxima by :func:`_prefix_max` (``cummax`` over a selection of unbacked size
    does not trace; taking every chunk's and selecting made the program's log-space form 1.7-2x slower on inputs
    that mark none): the blocks, ``C x C x M`` each, only where marked, as eager computes them; every chunk's
    block took 13 s at L = 4,096 (H = 8, M = 256)."""
    dense = (torch.compiler.is_compiling() and not torch.compiler.is_exporting()) or transforms.active()
    sel = (slice(None),) * 3 if dense else pairwise.nonzero(as_tuple=True)
    sel_only = torch.compiler.is_exporting() and not dense   # (a selection of unbacked size: no cummax)

    def shifts(lq: Tensor, lk: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        # from detached values (no grad-mode switch: a program's torch.cond branches hold none)
        mk = torch.maximum(_prefix_max(lk.detach()) if sel_only else torch.cummax(lk.detach(), dim=-2).values,
                           prev.detach())
        c_pos = (lq.detach() + mk).amax(-1, keepdim=True)                 # per position
        c_chunk = (lq.detach() + torch.maximum(prev.detach(), lk.detach()[..., :1, :])).amax(-1, keepdim=True)
        return c_pos, c_chunk

    lq_s, lk_s, prev_s = lq[sel], lk[sel], prev[sel]
    a_s = None if a is None else a[sel]
    b_s = None if b is None else b[sel]
    c_pos, c_chunk = shifts(lq_s, lk_s, prev_s)
    block = _pairwise(lq_s, lk_s, c_pos, a_s, b_s, future)
    rescale = torch.exp(c_chunk - c_pos)                                   # (..., C, 1), <= 1
    if dense:
        sel_ = pairwise[..., None, None]
        return torch.where(sel_, block, A), q_inter * torch.where(sel_, rescale, torch.ones_like(rescale))
    return A.index_put(sel, block), q_inter.index_put(sel, q_inter[sel] * rescale)


def log_space_causal(lq: Tensor, lk: Tensor, v: Tensor, a: Tensor | None = None, b: Tensor | None = None,
                     pad: Tensor | None = None, state: tuple[Tensor, Tensor, Tensor] | None = None, *,
                     chunk: int = DEFAULT_CHUNK, recompute: str = "auto", dynamic: bool | None = None
                     ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Causal random-feature attention from log-space features; ``(out (B, H, L, E), (S, z, m))``.

    Args:
        lq: ``(B, H, L, M)`` query exponents (``(B, H, L, 1)`` broadcasts).
        lk: ``(B, H, L, M)`` key exponents, or ``(B, H, L, 1)`` (one per key, the trig map).
        v: ``(B, H, L, E)``.
        a, b: ``(B, H, L, M)`` bounded multipliers of the query and key features (None: 1).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (they write nothing), or None.
        state: ``(S (B, H, M, E), z (B, H, M), m (B, H, Mk))`` carried in (``m`` the reference of ``S``
            and ``z``, ``Mk`` = ``lk``'s last dim), or None (nothing seen).
        chunk: positions per chunk.
        recompute: which chunks get the pairwise block: ``"auto"`` those whose growth exceeds the limit (a
            branch on the data in eager; in a program (``torch.export``) the marked chunks selected, a count of
            their own, no ``torch.cond``), or ``"marked"`` (those marked, selected, whatever the caller).
        dynamic: the length is one ``torch.export`` traces as dynamic (the chunk count from
            :func:`.common.group_chunk_count`, the chunks' start states from :func:`.common.chunk_outputs`);
            None: :func:`attnkit.transforms.symbolic` says (a caller inside a ``torch.cond`` branch, where the
            length no longer reads as symbolic, passes it).

    Returns:
        The normalised output (0 where a query has seen no key) and the new state.

    Raises:
        ValueError: ``recompute`` is neither ``"auto"`` nor ``"marked"``.
    """
    if recompute not in ("auto", "marked"):
        raise ValueError(f"log_space_causal: recompute must be 'auto' or 'marked', got {recompute!r}")
    B, H, L, _ = lq.shape
    dynamic = transforms.symbolic(L) if dynamic is None else dynamic
    if recompute == "auto" and torch.compiler.is_exporting() and not transforms.active():
        # a program selects the marked chunks (none selected: the form without pairwise blocks, at the cost of a
        # few passes over the exponents); a torch.cond between the two forms made the export 5x slower (its
        # branches traced by dynamo: 16 s against 2-4 s for an L-dynamic trace of either form alone)
        recompute = "marked"
    M = lq.shape[-1] if a is None else a.shape[-1]
    M = max(M, lk.shape[-1] if b is None else b.shape[-1])
    Mk = lk.shape[-1]
    E = v.shape[-1]
    dt = v.dtype
    limit = GROWTH_LIMIT.get(dt, 20.0)
    vp = with_ones_column(v)
    if pad is not None:
        vp = vp.masked_fill(pad, 0.0)
    if state is None:
        Sp = vp.new_zeros(B, H, M, E + 1)
        m0 = vp.new_full((B, H, Mk), NO_KEY)
    else:
        S0, z0, m0 = state
        Sp = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)
    if not dynamic and L == 0:
        return v.new_zeros(B, H, 0, E), (Sp[..., :E], Sp[..., E], m0)
    C = max(1, chunk) if dynamic else max(1, min(chunk, L))
    N = group_chunk_count(L, C) if dynamic else -(-L // C)     # dynamic: whole groups of chunk_outputs
    lk_c = _chunks(lk.masked_fill(pad, NO_KEY) if pad is not None else lk, C, N, NO_KEY, dynamic)
    # (detached: no grad-mode switch, see _pairwise_chunks)
    end, prev, first = _references(lk_c.detach(), m0.detach())
    growth = (end - first).amax(dim=(-2, -1))                                         # (B, H, N)
    pairwise = growth > limit
    lq_c = _chunks(lq, C, N, NO_KEY, dynamic)                               # tail queries: factors exp(-1e30) = 0
    a_c = None if a is None else _chunks(a, C, N, 0.0, dynamic)
    if b is not None and pad is not None:
        b = b.masked_fill(pad, 0.0)                                         # NaN there must not reach A @ v
    b_c = None if b is None else _chunks(b, C, N, 0.0, dynamic)
    vp_c = _chunks(vp, C, N, 0.0, dynamic)

    def times(x: Tensor, y: Tensor | None) -> Tensor:
        return x if y is None else x * y

    t = lq_c + first                                                        # (B, H, N, C, M)
    c_c = t.detach().amax(-1, keepdim=True)                                 # the query's shift c_t
    q_intra = torch.exp(t - c_c)                                            # <= 1, the largest 1
    q_inter = times(q_intra * torch.exp(prev - first), a_c)                 # <= 1 (prev <= first)
    q_intra = times(q_intra, a_c)
    k_state = torch.exp(lk_c - end)                                         # <= 1
    k_intra = times(k_state * torch.exp(torch.clamp(end - first, max=limit)), b_c)   # <= e^growth
    k_state = times(k_state, b_c)
    future = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1)
    A = (q_intra @ k_intra.transpose(-1, -2)).masked_fill(future, 0.0)     # (B, H, N, C, C)
    if recompute == "marked":
        A, q_inter = _pairwise_chunks(A, q_inter, pairwise, lq_c, lk_c, prev, a_c, b_c, future)
    elif torch.compiler.is_compiling() or transforms.active() or bool(pairwise.any()):   # (no data branch there)
        A, q_inter = _pairwise_chunks(A, q_inter, pairwise, lq_c, lk_c, prev, a_c, b_c, future)
    intra = A @ vp_c                                                        # (B, H, N, C, E+1)
    kv = k_state.transpose(-1, -2) @ vp_c                                   # (B, H, N, M, E+1)
    if dynamic:   # every chunk's start state in two levels (a loop over the chunks would fix their count)
        out, Sp = chunk_outputs(end[:, :, :, 0], m0.detach(), kv.expand(B, H, -1, M, E + 1), Sp,
                                q_inter.expand(B, H, -1, C, M), intra)
        out = out.reshape(B, H, -1, E + 1)[:, :, :L]
        return normalize(out[..., :E], out[..., E]), (Sp[..., :E], Sp[..., E], end[:, :, -1, 0])
    decay = torch.exp(prev - end).transpose(-1, -2)                         # (B, H, N, Mk, 1), <= 1
    starts = [Sp]
    for n in range(N - 1):  # over chunks, not positions: one fused op each (few ops: cheap under contention)
        starts.append(torch.addcmul(kv[:, :, n], decay[:, :, n], starts[-1]))
    Sp = torch.addcmul(kv[:, :, N - 1], decay[:, :, N - 1], starts[-1])
    out = torch.baddbmm(intra.reshape(-1, C, E + 1), q_inter.reshape(-1, C, M),
                        torch.stack(starts, dim=2).reshape(-1, M, E + 1))           # every chunk at once
    out = out.reshape(B, H, N * C, E + 1)[:, :, :L]
    m_end = end[:, :, -1, 0]
    return normalize(out[..., :E], out[..., E]), (Sp[..., :E], Sp[..., E], m_end)

