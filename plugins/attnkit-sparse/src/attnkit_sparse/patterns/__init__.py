"""The position-based patterns as mask objects (usable with any attention that executes masks) and modules.

Each ``*_mask`` constructor returns an :class:`attnkit.masks.Mask`; the
``*Attention`` classes are the registered modules (see
:mod:`attnkit_sparse.plugin`).
"""

from .block_sparse import BlockSparseAttention
from .bp import BPTransformerAttention, bp_mask
from .global_ import GlobalAttention, LongformerAttention, global_mask, longformer_mask
from .grid import AxialAttention, Local2DAttention, axial_mask, local_2d_mask
from .local import (
    BlockLocalAttention,
    DilatedAttention,
    LocalAttention,
    block_local_mask,
    dilated_mask,
    local_mask,
)
from .random_ import BigBirdAttention, RandomAttention, bigbird_mask, random_mask
from .sparse_transformer import FixedAttention, StridedAttention, fixed_mask, strided_mask

__all__ = [
    "local_mask", "dilated_mask", "block_local_mask", "global_mask", "longformer_mask", "random_mask",
    "bigbird_mask", "strided_mask", "fixed_mask", "local_2d_mask", "axial_mask", "bp_mask",
    "LocalAttention", "DilatedAttention", "BlockLocalAttention", "GlobalAttention", "LongformerAttention",
    "RandomAttention", "BigBirdAttention", "StridedAttention", "FixedAttention", "Local2DAttention",
    "AxialAttention", "BPTransformerAttention", "BlockSparseAttention",
]
