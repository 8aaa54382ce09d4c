"""attnkit-adaptive: adaptive attention span, dynamic span, alpha-entmax and the ACT / Universal Transformer block.

Importing this package imports no mechanism; :mod:`attnkit_adaptive.plugin`
registers them by import path (``attnkit.build("adaptive-span", ...)``).
"""

__version__ = "0.1.0"
