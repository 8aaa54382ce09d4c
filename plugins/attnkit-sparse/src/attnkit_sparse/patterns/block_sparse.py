"""``block-sparse``: no pattern of its own; runs the caller's mask object on the block-sparse engine.

A third party's pattern written as a mask function
(``attnkit.masks.from_function``) runs on the engine's kernels with no kernel
code: ``attnkit.build("block-sparse")(q, k, v, mask=my_mask)``.
"""

from __future__ import annotations

from attnkit.masks import Mask

from ..base import SparsePatternAttention

__all__ = ["BlockSparseAttention"]


class BlockSparseAttention(SparsePatternAttention):
    """Softmax attention over exactly the pairs the caller's mask allows, executed from its block index.

    ``forward(q, k, v, mask=m)`` with any :class:`attnkit.masks.Mask`
    (``from_function``, ``sliding_window``, ``document``, ``&``/``|`` of
    them, bool ``attn_mask``, ``causal=True``, ``key_padding_mask``). Cost is
    proportional to the tiles the mask does not skip; with no mask every
    pair is attended (dense softmax on the engine). Exact: it equals
    ``softmax`` with the same mask.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)

    def _pattern(self, causal: bool) -> Mask | None:
        return None
