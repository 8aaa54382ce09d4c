"""attnkit-adaptive: adaptive attention span, dynamic span, alpha-entmax and the ACT / Universal Transformer block.

Importing this package imports no mechanism; :mod:`attnkit_adaptive.plugin`
registers them by import path (``attnkit.build("adaptive-span", ...)``). It registers the span band's custom
operators (:mod:`attnkit_adaptive.span.ops`, no numba import), so ``torch.export.load`` of a program on the numba
backend needs only ``import attnkit_adaptive``.
"""

from .span import ops as _span_ops  # noqa: F401  (registers attnkit_adaptive::span_band and its backward)

__version__ = "0.1.0"
