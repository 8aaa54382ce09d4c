"""Every feature map phi: R^D -> R^M of the kernelized attentions (the one copy), and random-feature draws.

Deterministic maps (``linear`` and ``fast-weight``), applied to the last dim:

* ``elu``: ``elu(x) + 1`` (Katharopoulos et al. 2020), M = D, positive.
* ``relu``: ``relu(x)``, M = D, non-negative (a row of zeros is possible).
* ``softplus``: ``log(1 + e^x)``, M = D, positive.
* ``dpfp``: DPFP-nu (Schlag et al. 2021): with ``r = relu([x, -x])`` (2D),
  ``phi = [r * roll(r, 1), ..., r * roll(r, nu)]``, M = 2·D·nu, non-negative.

Random features (``performer`` and ``rfa``), for a projection ``W`` of shape
``(M, D)`` drawn by :func:`draw_gaussian_features`:

* :func:`favor_positive`: FAVOR+ positive features
  ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(M)``, so that
  ``E[phi(x) . phi(y)] = exp(x . y)`` (Choromanski et al. 2021, Lemma 1).
* :func:`favor_trig`: the Performer v1 trigonometric map
  ``phi(x) = exp(|x|^2 / 2) / sqrt(M) [sin(W x), cos(W x)]`` (2M features,
  unbiased for ``exp(x . y)`` but not positive).
* :func:`favor_generalized`: the generalized kernel ``relu(W x) + eps``.
* :func:`random_fourier`: ``sqrt(1/M) [sin(W x), cos(W x)]`` (RFA), an
  estimate of the Gaussian kernel ``exp(-|x - y|^2 / 2)`` for W ~ N(0, I).

Stabilisers. The exponential maps take ``stabilize``: ``None`` computes the
map as written (unbiased; what the references use); ``"row"`` subtracts a
per-row constant in the exponent (queries: it cancels between numerator and
denominator, and a NaN row stays in its row); ``"keys"`` subtracts the maximum
over the rows that ``keep`` marks as real keys and over features, per leading
index (a constant for every key of a (batch, head): it cancels too). Padded
keys never enter that maximum, so whatever they hold (NaN, Inf, large values)
cannot shift or poison real features. These shifts are detached: they are
constants that cancel, not part of the function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

FeatureMap = Callable[[Tensor], Tensor]

#: Names of the deterministic feature maps accepted by ``feature_map=``.
DETERMINISTIC_MAPS = ("elu", "relu", "softplus", "dpfp")


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1``: (..., D) -> (..., D), values > 0."""
    return F.elu(x) + 1.0


def relu_feature_map(x: Tensor) -> Tensor:
    """``relu(x)``: (..., D) -> (..., D), values >= 0."""
    return F.relu(x)


def softplus_feature_map(x: Tensor) -> Tensor:
    """``softplus(x)``: (..., D) -> (..., D), values > 0."""
    return F.softplus(x)


def dpfp_feature_map(x: Tensor, nu: int = 1) -> Tensor:
    """DPFP-nu (deterministic parameter-free projection, Schlag et al. 2021, eq. 34).

    Args:
        x: ``(..., D)``.
        nu: number of rolls, >= 1.

    Returns:
        ``(..., 2·D·nu)``, values >= 0.
    """
    D = x.shape[-1]
    if nu > D:   # more rolls than the prefix below holds: the definition as written
        r = F.relu(torch.cat([x, -x], dim=-1))
        return torch.cat([r * torch.roll(r, shifts=i, dims=-1) for i in range(1, nu + 1)], dim=-1)
    # r = relu([x, -x]) with its last nu entries repeated in front, so ``roll(r, i)`` is a slice of it:
    # one concatenation and one relu instead of a roll (a copy) per product (the same products, bit for bit;
    # 37 against 60 ms for (1, 8, 8192, 64) float32 on two threads)
    ext = F.relu(torch.cat([x[..., D - nu:].neg(), x, -x], dim=-1))     # r_{-nu} .. r_{2D-1}
    r = ext[..., nu:]
    n = r.shape[-1]
    parts = [r * ext[..., nu - i:nu - i + n] for i in range(1, nu + 1)]
    return parts[0] if nu == 1 else torch.cat(parts, dim=-1)


def deterministic_feature_map(name: str, *, nu: int = 1) -> FeatureMap:
    """The map called ``name`` (one of :data:`DETERMINISTIC_MAPS`; the caller validates it), picklable."""
    if name == "dpfp":
        return functools.partial(dpfp_feature_map, nu=nu)
    return {"elu": elu_feature_map, "relu": relu_feature_map, "softplus": softplus_feature_map}[name]


def feature_dim(name: str, head_dim: int, *, nu: int = 1) -> int:
    """Number of features M that the deterministic map ``name`` gives for ``head_dim`` inputs."""
    return 2 * head_dim * nu if name == "dpfp" else head_dim


def sum_normalized(f: Tensor) -> Tensor:
    """``f / sum_i f_i`` over the last dim; a row summing to 0 stays 0 (fast-weight's normalisation)."""
    s = f.sum(-1, keepdim=True)
    return f / torch.where(s == 0, torch.ones_like(s), s)


# ----------------------------------------------------------- random features
def draw_gaussian_features(num_features: int, dim: int, *, orthogonal: bool = True,
                           generator: torch.Generator | None = None,
                           dtype: torch.dtype = torch.float32) -> Tensor:
    """Random projection ``W`` of shape ``(num_features, dim)`` with rows marginally N(0, I).

    With ``orthogonal=True`` the rows are orthogonal in blocks of ``dim``
    (QR of Gaussian blocks), each row rescaled by the norm of an independent
    Gaussian vector so its length follows the chi distribution of a Gaussian
    row (the Performer's positive orthogonal random features, ORF).

    Args:
        num_features: M >= 1.
        dim: D >= 1.
        orthogonal: ORF (True) or i.i.d. Gaussian rows (False).
        generator: the random source (None = torch's global RNG).
        dtype: dtype of the result (drawn in float64).
    """
    if not orthogonal:
        return torch.randn(num_features, dim, generator=generator, dtype=torch.float64).to(dtype)
    n_blocks = -(-num_features // dim)
    g = torch.randn(n_blocks, dim, dim, generator=generator, dtype=torch.float64)
    qmat, r = torch.linalg.qr(g)
    # sign fix so each block is Haar-distributed; rows of Q^T are orthonormal
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    qmat = qmat * torch.where(sign == 0, torch.ones_like(sign), sign).unsqueeze(-2)
    w = qmat.transpose(-1, -2).reshape(n_blocks * dim, dim)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (w * norms).to(dtype)


def key_max(t: Tensor, keep: Tensor | None) -> Tensor:
    """Max of ``t (..., S, F)`` over the rows ``keep (..., S, 1)`` marks and over F, ``(..., 1, 1)``, detached.

    Rows left out (padded keys) never enter the max; 0 when no row is kept.
    """
    t = t.detach()
    if keep is not None:
        t = t.masked_fill(~keep, float("-inf"))
    m = t.amax(dim=(-2, -1), keepdim=True) if t.shape[-2] else t.new_zeros(*t.shape[:-2], 1, 1)
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _shift(logits: Tensor, stabilize: str | None, keep: Tensor | None) -> Tensor:
    """``logits`` minus the stabiliser named ``stabilize`` (in place: ``logits`` is a fresh tensor)."""
    if stabilize == "row":
        return logits.sub_(logits.detach().amax(-1, keepdim=True))
    if stabilize == "keys":
        return logits.sub_(key_max(logits, keep))
    return logits


def favor_positive(x: Tensor, w: Tensor, *, scale: float = 1.0, stabilize: str | None = None,
                   keep: Tensor | None = None) -> Tensor:
    """FAVOR+ positive random features ``exp(W x - |x|^2/2 - c) / sqrt(M)`` of ``scale · x``.

    Args:
        x: ``(..., D)``.
        w: ``(M, D)``.
        scale: the features are those of ``scale · x`` (Performer: ``sqrt`` of the
            attention scale), folded into ``w`` instead of copying ``x``.
        stabilize: None (``c = 0``, the unbiased estimate
            ``E[phi(x) . phi(y)] = exp(x . y)``), ``"row"`` or ``"keys"``
            (see the module docstring). With ``"row"`` the per-row factor
            ``exp(-|x|^2/2) / sqrt(M)`` is left out as well: each row is
            ``exp(W x - max_i (W x)_i)``, its largest feature 1.
        keep: ``(..., S, 1)`` bool, the real keys, for ``stabilize="keys"``.

    Returns:
        ``(..., M)``, values > 0 (0 where a stabilised exponent underflows).
    """
    logits = x @ (w * scale).transpose(0, 1)                  # a fresh tensor: shifted in place
    if stabilize == "row":
        return _shift(logits, "row", None).exp_()
    logits.sub_((0.5 * scale * scale) * (x * x).sum(-1, keepdim=True) + 0.5 * math.log(w.shape[0]))
    return _shift(logits, stabilize, keep).exp_()


def favor_trig(x: Tensor, w: Tensor, *, scale: float = 1.0, stabilize: str | None = None,
               keep: Tensor | None = None, drop_norm: bool = False) -> Tensor:
    """Performer v1 trigonometric features ``exp(|x|^2/2 - c) / sqrt(M) [sin(W x), cos(W x)]`` of ``scale · x``.

    Args:
        x: ``(..., D)``; w: ``(M, D)``.
        scale: the features are those of ``scale · x`` (folded into ``w``).
        stabilize: None or ``"keys"`` (a shift of the ``|x|^2/2`` exponent, see the module docstring).
        keep: ``(..., S, 1)`` bool, the real keys, for ``stabilize="keys"``.
        drop_norm: leave out the ``exp(|x|^2/2)`` factor (valid for queries,
            where it is a per-row constant that cancels in the normalisation).

    Returns:
        ``(..., 2M)``; not positive, so the attention denominator can vanish.
    """
    proj = x @ (w * scale).transpose(0, 1)
    feats = torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) * w.shape[0] ** -0.5
    if drop_norm:
        return feats
    log_norm = _shift((0.5 * scale * scale) * (x * x).sum(-1, keepdim=True), stabilize, keep)
    return feats * torch.exp(log_norm)


#: added to the generalized (relu) kernel's features, as in the Performer reference code
GENERALIZED_EPS = 1e-3


def favor_generalized(x: Tensor, w: Tensor, *, scale: float = 1.0, eps: float = GENERALIZED_EPS) -> Tensor:
    """Generalized-kernel features ``relu(W x) + eps`` of ``scale · x`` (no softmax estimate), ``(..., M)``."""
    return F.relu(x @ (w * scale).transpose(0, 1)) + eps


def random_fourier(x: Tensor, w: Tensor) -> Tensor:
    """Random Fourier features ``sqrt(1/M) [sin(W x), cos(W x)]`` (RFA), ``(..., 2M)``.

    ``phi(x) . phi(y) = (1/M) sum_i cos(w_i . (x - y))``, an unbiased estimate
    of ``exp(-|x - y|^2 / 2)`` for rows ``w_i ~ N(0, I)``.
    """
    proj = x @ w.transpose(0, 1)
    return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) * w.shape[0] ** -0.5
