"""attnkit-sparse: position-based sparse attention patterns on one block-sparse engine.

Every pattern is an :class:`attnkit.masks.Mask`; :func:`attnkit_sparse.engine.attend`
executes any mask (pattern ``&`` causal ``&`` padding ``&`` document) from its
block index on torch, numba (CPU), FlexAttention and triton (CUDA).
"""

__version__ = "0.1.0"
