"""The kernelized family split along L across gloo ranks (:mod:`attnkit.context_parallel`).

Each rank sends a summary of its chunk (linear: ``phi(k)^T v`` and ``sum phi(k)``;
performer: the same relative to the per-feature key maximum; rfa: also the
chunk's total decay; fast-weight: the chunk's affine map of the state), folds
those of the earlier ranks into its starting state and runs its chunk. Outputs,
input gradients and parameter gradients must equal one process's in float64,
with uneven chunks and NaN/Inf in padded keys and values.
"""

from __future__ import annotations

import pytest

import attnkit
from attnkit.testing.context_parallel import check_context_parallel

H, D = 2, 8
CASES = [
    ("linear", {"backend": "torch"}),
    ("linear", {"backend": "numba", "feature_map": "relu"}),
    ("performer", {"num_features": 16, "seed": 1}),                           # positive map: log space
    ("performer", {"num_features": 16, "seed": 1, "feature_map": "trig"}),
    ("performer", {"num_features": 16, "seed": 1, "feature_map": "generalized"}),
    ("rfa", {"num_features": 8, "seed": 1, "num_heads": H, "head_dim": D}),  # gated
    ("rfa", {"num_features": 8, "seed": 1, "num_heads": H, "head_dim": D, "gate": False}),
    ("fast-weight", {"num_heads": H, "head_dim": D}),
    ("fast-weight", {"num_heads": H, "head_dim": D, "backend": "numba"}),
]


def test_every_kernelized_attention_declares_the_capability():
    for name in ("linear", "performer", "rfa", "fast-weight"):
        assert attnkit.get_spec(name).capabilities.context_parallel, name


@pytest.mark.parametrize("world,lengths", [(2, [5, 6]), (3, [1, 6, 3])])
def test_split_equals_one_process(world, lengths):
    cases = [(n, {"head_dim": D, **o}) for n, o in CASES]
    failures = check_context_parallel(cases, worlds=[world], lengths=lengths, shape=(2, H, D, D))
    assert not failures, "\n".join(failures)
