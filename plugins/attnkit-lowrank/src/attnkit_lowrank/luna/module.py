"""``luna``: :class:`LunaAttention`, Linear Unified Nested Attention (Ma et al. 2021), the torch path.

A packed sequence ``P`` of ``m = packed_len`` vectors (learned, or the state a
previous call returned) packs the keys, then the queries unpack it::

    A  = softmax(scale · P K^T)             (m, S)   padded keys excluded
    K_p = A K,  V_p = A V                   (m, D), (m, E)   pack:   P' = Attn(P, X)
    out = softmax(scale · Q K_p^T) V_p      (L, E)           unpack: Y  = Attn(X, P')

O((L + S)·m·D). The next packed sequence, returned as state
(``forward(..., return_state=True)``), is the paper's layer update
``LayerNorm(P + P')`` (no affine) with ``P' = K_p``, the pack in the key space
(width D, where P lives: the value width E may differ). In the paper pack and
unpack each have their own projections of one model-width P'; the attention
contract takes q, k, v already projected, so the packed keys and values are
the weighted sums of k and v themselves (the model layer owns projections).

Causal form (L == S), ``causal_form="paper"`` (default), the paper's causal
Luna: the pack weights are ``w_jl = elu(scale · p_l·k_j) + 1`` (positive, no
normalisation over positions) and query t unpacks the mean over the t' keys
``j <= t`` (t' = t + 1, or the number of real keys among them):
``K_p(t) = (1/t') sum_{j<=t} w_j k_j``, ``V_p(t) = (1/t') sum_{j<=t} w_j v_j``,
``out_t = softmax(scale · q_t K_p(t)^T) V_p(t)`` — cumulative sums, as in the
paper. ``causal_form="prefix-softmax"``: the causal restriction of the
non-causal equations, ``A_t = softmax over j <= t of scale · P k_j``, computed
with a log-cumulative-sum-exp of the pack scores (no overflow, no 0/0); its
last row equals the non-causal output. Both run in query chunks: the paper's
form as two causal products of the shape of linear attention, O(L·chunk·(D + m
+ E) + L·m·(D + E)); the prefix softmax O(L·chunk·m·(D + E)). The state after
a causal call is the softmax pack of the whole chunk (for the next segment: it
summarises the chunk's future, so it is not for the next layer over the same
positions). While ``torch.export`` traces a dynamic length both causal forms
run with their chunks batched (``*_causal_unpack_batched``: no loop over a
chunk count, memory still linear in L), so one program serves every length.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError
from attnkit.transforms import symbolic

from ..common import Float32Inside, check_bool, check_choice, check_int, softmax_attend, windows
from ..plugin import LUNA


def _logcumsumexp(x: Tensor, dim: int) -> Tensor:
    """``torch.logcumsumexp`` whose gradient stays finite where inputs are ``-inf``: they count as the dtype's
    lowest finite value / 4 (their terms still vanish: ``exp`` of it is 0 against any real term), so an output
    over nothing but such terms is that value, not ``-inf`` (torch's backward divides by ``exp`` of the output
    and gave NaN there: every dk of a dynamic-length prefix-softmax program). No gradient reaches the clamped
    inputs."""
    return torch.logcumsumexp(x.clamp_min(torch.finfo(x.dtype).min / 4), dim)


CAUSAL_FORMS = ("paper", "prefix-softmax")


class LunaAttention(Float32Inside, attnkit.Attention):
    """Luna: a packed sequence of m vectors packs the keys, the queries attend to the pack.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``; with ``return_state=True`` also the next packed
    sequence ``(B, H, m, D)`` in an :class:`attnkit.AttentionState` (pass it to
    the next layer's or the next segment's ``forward(state=...)``). Non-causal
    (also cross-attention) and causal (L == S); key padding (padded keys get no
    weight in the pack; a row with no real key gives 0).

    Args:
        num_heads: number of heads H (required with ``per_head=True``).
        head_dim: head dimension D of the packed sequence (required).
        scale: multiplier of ``q·k`` in both attentions; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        packed_len: m, the length of the packed sequence (the paper's l: 16, 128 or 256).
        per_head: one learned packed sequence per head instead of one shared.
        chunk_size: queries per chunk of the causal form; None (default): 64 for
            ``causal_form="paper"`` (memory O(chunk·(chunk + m) + m·(D + E))), 16 for
            ``"prefix-softmax"`` (memory O(chunk·m·(chunk + D + E))).
        causal_form: ``"paper"`` (the paper's causal Luna: pack weights
            ``elu(scale·p·k) + 1`` averaged over the visible keys) or
            ``"prefix-softmax"`` (the non-causal pack's softmax over each prefix).

    Raises:
        InvalidInputError: an option of the wrong type or out of range; a state
            from another configuration, batch size, dtype or device.
        UnsupportedFeatureError: ``attn_mask``, other mask kinds, causal with L != S.
    """

    option_constraints = {"packed_len": {"minimum": 1}, "chunk_size": {"minimum": 1},
                          "causal_form": {"choices": CAUSAL_FORMS}}
    capabilities = LUNA.capabilities
    refusal_reasons = {
        "attn_mask": "a per-pair mask cannot be applied through the packed sequence",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", packed_len: int = 16, per_head: bool = False,
                 chunk_size: int | None = None, causal_form: str = "paper") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.packed_len = check_int("packed_len", packed_len)
        self.per_head = check_bool("per_head", per_head)
        check_int("chunk_size", chunk_size, allow_none=True)
        self.causal_form = check_choice("causal_form", causal_form, CAUSAL_FORMS)
        self.chunk_size = chunk_size if chunk_size is not None else 64 if causal_form == "paper" else 16
        if head_dim is None:
            raise InvalidInputError("head_dim: the packed sequence holds head_dim vectors; give head_dim")
        if per_head and num_heads is None:
            raise InvalidInputError("num_heads: per_head=True keeps a packed sequence per head; give num_heads")
        p = num_heads if per_head else 1
        self.packed = nn.Parameter(torch.randn(p, packed_len, head_dim) / math.sqrt(head_dim))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, packed_len={self.packed_len}, per_head={self.per_head}, "
                f"causal_form={self.causal_form!r}")

    def start(self, q: Tensor, state: Tensor | None) -> Tensor:
        """The packed sequence P: ``state`` ``(B, H, m, D)`` or the learned one, broadcastable to it."""
        return self.packed.to(q.dtype) if state is None else state

    def pack(self, p: Tensor, k: Tensor, v: Tensor, scale: float, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """Packed keys ``(B, H, m, D)`` and values ``(B, H, m, E)`` over the whole key sequence."""
        s = (scale * p) @ k.transpose(-1, -2)                                  # (B, H, m, S)
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
        a = torch.softmax(s, -1)
        if keep is not None:
            a = a * keep[:, None, None, :].to(a.dtype)                          # no real key: all 0
        return a @ k, a @ v

    def next_state(self, p: Tensor, k_p: Tensor) -> Tensor:
        """``LayerNorm(P + K_p)`` over D (no affine): the next packed sequence ``(B, H, m, D)``."""
        x = p + k_p
        return nn.functional.layer_norm(x, x.shape[-1:])

    def causal_unpack(self, q: Tensor, p: Tensor, k: Tensor, v: Tensor, scale: float,
                      keep: Tensor | None) -> Tensor:
        """Causal form: query t attends to the pack of keys ``0..t``; ``(B, H, L, E)``."""
        B, H, L, D = q.shape
        E = v.shape[-1]
        p = p.expand(B, H, *p.shape[-2:])
        s = (scale * p) @ k.transpose(-1, -2)                                  # (B, H, m, L)
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
        m = s.shape[2]
        lse0 = s.new_full((B, H, m), float("-inf"))
        kp0 = k.new_zeros(B, H, m, D)
        vp0 = v.new_zeros(B, H, m, E)
        outs = []
        size = self.chunk_size
        keeps = [None] * len(range(0, L, size)) if keep is None else keep.split(size, -1)
        # split, not slicing: a slice's backward writes a whole (B, H, ., L) zero tensor per chunk (quadratic in L)
        for sc, kc, vc, qc, kpc in zip(s.split(size, -1), k.split(size, 2), v.split(size, 2), q.split(size, 2), keeps):
            c = sc.shape[-1]                                                    # sc: (B, H, m, c)
            lse = torch.logaddexp(lse0[..., None], torch.logcumsumexp(sc, -1))  # (B, H, m, c): log sum_{j<=t}
            carry = torch.exp(lse0[..., None] - lse)                            # weight of the earlier pack
            tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()    # [t, j]: j <= t
            # (B, H, m, t, j); j > t set to -inf before exp (its score may exceed lse_t: inf·0 = NaN)
            w = torch.exp((sc[..., None, :] - lse[..., :, None]).masked_fill(~tri, float("-inf")))
            if kpc is not None:
                w = w * kpc[:, None, None, None, :].to(w.dtype)
            kp = carry[..., None] * kp0[..., None, :] + w @ kc[:, :, None]      # (B, H, m, t, D)
            vp = carry[..., None] * vp0[..., None, :] + w @ vc[:, :, None]      # (B, H, m, t, E)
            sq = scale * torch.einsum("bhtd,bhmtd->bhtm", qc, kp)
            outs.append(torch.einsum("bhtm,bhmte->bhte", torch.softmax(sq, -1), vp))
            lse0, kp0, vp0 = lse[..., -1], kp[..., -1, :], vp[..., -1, :]
        return torch.cat(outs, 2)

    @staticmethod
    def _paper_weights(q: Tensor, p: Tensor, k: Tensor, scale: float, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """The paper form's pack weights ``w = elu(scale · P k) + 1`` ``(B, H, L, m)`` (0 at padded keys) and each
        query's count of visible real keys ``(B, 1, L, 1)`` (at least 1: a query with none sums 0)."""
        B, H, L, _ = q.shape
        p = p.expand(B, H, *p.shape[-2:])
        w = nn.functional.elu((scale * k) @ p.transpose(-1, -2)) + 1
        if keep is None:
            count = torch.arange(1, L + 1, device=q.device, dtype=q.dtype).expand(B, L)
        else:
            w = w * keep[:, None, :, None].to(w.dtype)
            count = keep.to(q.dtype).cumsum(-1)                                  # real keys among 0..t
        return w, count.clamp(min=1)[:, None, :, None]

    def paper_causal_unpack(self, q: Tensor, p: Tensor, k: Tensor, v: Tensor, scale: float,
                            keep: Tensor | None) -> Tensor:
        """The paper's causal form: pack weights ``elu(s) + 1``, the mean over the visible keys; ``(B, H, L, E)``.

        With ``w_j = elu(scale · P k_j) + 1`` ``(m,)`` and t' visible keys, the
        unpack scores are ``scale/t' · sum_{j<=t} (q_t·k_j) w_j`` and the output
        ``1/t' · sum_{j<=t} (a_t·w_j) v_j`` — two causal products of the shape of
        linear attention. Per chunk of queries: the earlier chunks through running
        sums ``sum k_j w_j^T`` ``(D, m)`` and ``sum w_j v_j^T`` ``(m, E)``, the chunk
        itself through lower-triangular ``(chunk, chunk)`` products: O(L·chunk·(D +
        m + E) + L·m·(D + E)), no ``(m, t, D)`` tensor; the chunks are ``split``, not
        sliced (a slice's backward writes a whole zero tensor per chunk: at L = 16K
        that made forward + backward 13.5 s instead of 0.33 s).
        """
        B, H, L, D = q.shape
        E = v.shape[-1]
        w, count = self._paper_weights(q, p, k, scale, keep)
        m = w.shape[-1]
        sk, sv = k.new_zeros(B, H, D, m), v.new_zeros(B, H, m, E)               # sums over earlier chunks
        outs = []
        # split, not slicing: a slice's backward writes a whole (B, H, L, .) zero tensor per chunk (quadratic in L)
        c = self.chunk_size
        for qc, kc, vc, wc, n in zip(q.split(c, 2), k.split(c, 2), v.split(c, 2), w.split(c, 2), count.split(c, 2)):
            tri = torch.ones(qc.shape[2], qc.shape[2], dtype=q.dtype, device=q.device).tril()   # [t, j]: j <= t
            sq = (scale * (qc @ sk + ((qc @ kc.transpose(-1, -2)) * tri) @ wc)) / n     # (B, H, c, m)
            att = torch.softmax(sq, -1)
            outs.append((att @ sv + ((att @ wc.transpose(-1, -2)) * tri) @ vc) / n)
            sk = sk + kc.transpose(-1, -2) @ wc
            sv = sv + wc.transpose(-1, -2) @ vc
        return torch.cat(outs, 2)

    def _chunked(self, *xs: Tensor) -> list[Tensor]:
        """Each ``(B, ., L, F)`` tensor zero-padded to ``N·chunk_size`` positions and split: ``(B, ., N, chunk, F)``
        (:func:`~attnkit_lowrank.common.windows`: ``N`` an unbacked count under a dynamic-length export)."""
        return [windows(x, self.chunk_size) for x in xs]

    def paper_causal_unpack_batched(self, q: Tensor, p: Tensor, k: Tensor, v: Tensor, scale: float,
                                    keep: Tensor | None) -> Tensor:
        """:meth:`paper_causal_unpack` with its chunks batched (the form a dynamic-length export takes): each
        chunk's sums ``k_c^T w_c``, ``w_c^T v_c`` at once, the sums over earlier chunks an exclusive prefix sum
        over them. Memory O(L·(chunk + m) + L / chunk·m·(D + E)) per head; the same output."""
        B, H, L, D = q.shape
        E = v.shape[-1]
        w, count = self._paper_weights(q, p, k, scale, keep)
        qc, kc, vc, wc = self._chunked(q, k, v, w)                              # (B, H, N, c, .)
        n = windows(count - 1, self.chunk_size) + 1                             # (padded rows: 1, sliced off)
        N, c = qc.shape[2], qc.shape[3]
        sk_c, sv_c = kc.transpose(-1, -2) @ wc, wc.transpose(-1, -2) @ vc        # (B, H, N, D, m), (B, H, N, m, E)
        m = w.shape[-1]
        sk = torch.cat([k.new_zeros(B, H, 1, D, m), torch.cumsum(sk_c, 2)], 2)[:, :, :N]   # over earlier chunks
        sv = torch.cat([v.new_zeros(B, H, 1, m, E), torch.cumsum(sv_c, 2)], 2)[:, :, :N]
        tri = torch.ones(c, c, dtype=q.dtype, device=q.device).tril()          # [t, j]: j <= t
        sq = (scale * (qc @ sk + ((qc @ kc.transpose(-1, -2)) * tri) @ wc)) / n
        att = torch.softmax(sq, -1)
        out = (att @ sv + ((att @ wc.transpose(-1, -2)) * tri) @ vc) / n        # (B, H, N, c, E)
        return out.flatten(2, 3)[:, :, :L]

    def causal_unpack_batched(self, q: Tensor, p: Tensor, k: Tensor, v: Tensor, scale: float,
                              keep: Tensor | None) -> Tensor:
        """:meth:`causal_unpack` with its chunks batched (the form a dynamic-length export takes).

        The loop carries each chunk's start state (``lse0``, ``kp0``, ``vp0``: the log-sum-exp of the pack scores
        before the chunk and the packs normalised by it) from the chunk before. Here every chunk's start state
        comes at once from the chunks' own ones (``T_j`` the log-sum-exp of chunk j's scores, ``K_j`` its pack
        normalised by ``T_j``): ``lse0_n`` is the exclusive log-cumulative-sum-exp of ``T`` and
        ``kp0_n = sum_{j<n} exp(T_j - lse0_n) K_j``, its positive and negative parts each a log-cumulative-sum-exp
        of ``T_j + log K_j^±`` (no overflow, no 0/0, as the loop). Within a chunk the loop's expressions, batched.
        Memory O(L·m·(chunk + D + E)) per head (the loop: O(chunk·m·(chunk + D + E))); the same output to
        rounding.
        """
        B, H, L, D = q.shape
        p = p.expand(B, H, *p.shape[-2:])
        s = (scale * p) @ k.transpose(-1, -2)                                  # (B, H, m, L)
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
        qc, kc, vc = self._chunked(q, k, v)                                     # (B, H, N, c, .)
        N, c = qc.shape[2], qc.shape[3]
        # pad scores with -inf (no weight; a chunk of padding has T = -inf and packs 0), split (B, H, m, N, c)
        sc = windows(s.transpose(-1, -2), c).transpose(-1, -2).transpose(-2, -3)
        pad = torch.arange(N * c, device=q.device).view(N, c) >= L
        sc = sc.masked_fill(pad, float("-inf"))
        kw = None if keep is None else windows(keep[:, None, :, None].to(q.dtype), c)[:, :, None, :, :, 0]

        def weights(x: Tensor, lse: Tensor) -> Tensor:   # exp(x - lse), 0 where both are -inf
            return torch.exp(x - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))

        T = torch.logsumexp(sc, -1)                                             # (B, H, m, N)
        own = weights(sc, T[..., None])                                         # (B, H, m, N, c)
        if kw is not None:
            own = own * kw
        lcse = _logcumsumexp(T, -1)
        lse0 = torch.cat([torch.full_like(T[..., :1], float("-inf")), lcse], -1)[..., :N]   # before chunk n

        def before(x: Tensor) -> Tensor:   # sum_{j<n} exp(T_j - lse0_n) X_j for X (B, H, m, N, F) = own-weighted x
            X = torch.einsum("bhmnc,bhncf->bhmnf", own, x)                        # each chunk's own pack
            parts = []
            for sign in (1.0, -1.0):
                Xs = X * sign
                logx = torch.where(Xs > 0, torch.log(torch.where(Xs > 0, Xs, torch.ones_like(Xs))),
                                   torch.full_like(Xs, float("-inf")))
                acc = _logcumsumexp(T[..., None] + logx, 3)
                acc = torch.cat([torch.full_like(acc[:, :, :, :1], float("-inf")), acc], 3)[:, :, :, :N]
                parts.append(weights(acc, lse0[..., None]))
            return parts[0] - parts[1]

        kp0, vp0 = before(kc), before(vc)                                       # (B, H, m, N, D / E)
        lse = torch.logaddexp(lse0[..., None], _logcumsumexp(sc, -1))           # (B, H, m, N, c)
        carry = weights(lse0[..., None], lse)
        tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        w = torch.exp((sc[..., None, :] - lse[..., :, None]).masked_fill(~tri, float("-inf")))   # (B,H,m,N,t,j)
        if kw is not None:
            w = w * kw[..., None, :]
        kp = carry[..., None] * kp0[..., None, :] + w @ kc[:, :, None]          # (B, H, m, N, t, D)
        vp = carry[..., None] * vp0[..., None, :] + w @ vc[:, :, None]
        sq = scale * torch.einsum("bhntd,bhmntd->bhntm", qc, kp)
        out = torch.einsum("bhntm,bhmnte->bhnte", torch.softmax(sq, -1), vp)
        return out.flatten(2, 3)[:, :, :L]

    def _luna(self, q: Tensor, k: Tensor, v: Tensor, scale: float, keep: Tensor | None, causal: bool,
              state: Tensor | None, want_state: bool) -> Tensor | tuple[Tensor, Tensor]:
        p = self.start(q, state)
        k_p, v_p = self.pack(p, k, v, scale, keep)
        if causal and symbolic(q.shape[2]):
            # a dynamic length under torch.export: the chunks batched (a loop over them would fix the length)
            unpack = self.paper_causal_unpack_batched if self.causal_form == "paper" else self.causal_unpack_batched
            out = unpack(q, p, k, v, scale, keep)
        elif causal and self.causal_form == "paper":
            out = self.paper_causal_unpack(q, p, k, v, scale, keep)
        elif causal:
            out = self.causal_unpack(q, p, k, v, scale, keep)
        else:
            out = softmax_attend(q, (scale * k_p).transpose(-1, -2), v_p)
        if not want_state:
            return out
        B, H = q.shape[:2]
        return out, self.next_state(p.expand(B, H, *p.shape[-2:]), k_p)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx):
        return self._luna(q, k, v, ctx.scale, ctx.key_padding_mask, ctx.causal, ctx.state, ctx.return_state)

    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> None:
        return None                      # None: start from the learned packed sequence

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        return self._luna(q, k, v, self.get_scale(q), None, True, state, True)
