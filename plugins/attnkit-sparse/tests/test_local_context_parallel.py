"""``local`` (causal sliding window) split along L across gloo ranks: a halo of ``window - 1`` keys.

Windows shorter than a chunk, longer than a chunk (the halo spans several
earlier ranks) and of one key (no halo, no exchange); uneven chunks; NaN/Inf
in padded keys and values. Outputs and gradients equal one process's in float64.
"""

from __future__ import annotations

import attnkit
from attnkit.testing.context_parallel import check_context_parallel, run_cases


def test_local_split_equals_one_process():
    world, lengths = 3, [2, 7, 4]     # window 9 on the last rank: its halo spans both earlier ranks
    cases = [("local", {"window": w, "backend": b}) for w in (1, 3, 9) for b in ("torch", "numba")]
    failures = check_context_parallel(cases, worlds=[world], lengths=lengths, shape=(2, 2, 8, 8))
    assert not failures, "\n".join(failures)


def test_other_patterns_refuse_and_name_local():
    assert attnkit.get_spec("local").capabilities.context_parallel
    (res,) = run_cases([("dilated", {"window": 3})], world=2, lengths=[3, 3])
    assert res.status == "refused"
    assert "context parallelism" in res.message and "local" in res.message
