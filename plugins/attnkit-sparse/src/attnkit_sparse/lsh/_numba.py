"""numba kernel building the element masks of the sorted chunks (CPU): one pass, with spans and pair counts.

The same masks as :func:`attnkit_sparse.lsh.attention.chunk_masks` (torch), which the tests compare it with;
building them as a handful of broadcast torch ops costs several passes over ``n_hashes·L·2·bucket_size``
bools, this one writes each entry once.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(parallel=True, cache=True, nogil=True)
def chunk_masks(pos, real, cs, causal):  # pragma: no cover - compiled
    """``pos`` int64 ``(N, NQ·cs)`` sorted original positions (-1 past L), ``real`` bool ``(N, NQ·cs)``
    (key not padded) -> bank bool ``(N, NQ, 2, cs, cs)``, span int32 ``(N, NQ, 2, cs, 2)``, pairs int64 ``(N·NQ,)``."""
    N, T = pos.shape
    nq = T // cs
    bank = np.zeros((N, nq, 2, cs, cs), dtype=np.bool_)
    span = np.empty((N, nq, 2, cs, 2), dtype=np.int32)
    pairs = np.zeros(N * nq, dtype=np.int64)
    for item in numba.prange(N * nq):
        n = item // nq
        c = item % nq
        count = 0
        for slot in range(2):
            kc = c - 1 + slot
            for i in range(cs):
                pi = pos[n, c * cs + i]
                lo = cs
                hi = 0
                if kc >= 0 and pi >= 0:
                    for j in range(cs):
                        pj = pos[n, kc * cs + j]
                        ok = pj >= 0 and pj != pi and real[n, kc * cs + j] and (not causal or pj <= pi)
                        if ok:
                            bank[n, c, slot, i, j] = True
                            count += 1
                            if j < lo:
                                lo = j
                            hi = j + 1
                span[n, c, slot, i, 0] = lo
                span[n, c, slot, i, 1] = hi
        pairs[item] = count
    return bank, span, pairs
