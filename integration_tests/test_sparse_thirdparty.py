"""A third party's sparse pattern written only as a mask function (no kernel code), run on the sparse engine.

The pattern is registered in-process with ``attnkit.registered`` (always
unregistered afterwards), runs on the engine's numba kernels through
``attnkit_sparse``'s base class, and passes the conformance kit against the
plugin's dense reference.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Capabilities
from attnkit.masks import causal as causal_mask
from attnkit.masks import from_function
from attnkit.testing import AttentionConformance

pytest.importorskip("attnkit_sparse", reason="attnkit-sparse is not installed")

from attnkit_sparse.base import SparsePatternAttention  # noqa: E402
from attnkit_sparse.engine import why_unavailable  # noqa: E402

NAME = "thirdparty-every-third"


def every_third_or_near(b, h, q, kv):
    """Keys within one position, every third key back or ahead, and key 0 (an attention sink)."""
    return ((q - kv).abs() <= 1) | ((q - kv) % 3 == 0) | (kv == 0)


class EveryThirdAttention(SparsePatternAttention):
    """A third party's pattern: no kernel code, only the mask function above.

    Args:
        num_heads: number of heads H.
        head_dim: head dimension D.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba", "torch" (the sparse engine's).
    """

    def _pattern(self, causal):
        m = from_function(every_third_or_near, name="every-third-or-near")
        return m & causal_mask() if causal else m


CAPS = Capabilities(causal=True, noncausal=True, key_padding_mask=True, attn_mask=True, cross=True,
                    causal_cross=True, positions=True, backends=("numba", "torch"),
                    mask_kinds=("causal", "key_padding", "tensor", "sliding_window", "document", "function", "union"))


_NUMBA = why_unavailable("numba", torch.device("cpu"))
pytestmark = pytest.mark.skipif(_NUMBA is not None, reason=f"the sparse engine reports numba unavailable: {_NUMBA}")


@pytest.fixture(autouse=True, scope="module")
def registered():
    with attnkit.registered(EveryThirdAttention, name=NAME, family="custom", reference="attnkit_sparse.naive:reference",
                            summary="every third key, neighbours and a sink", capabilities=CAPS):
        yield


def test_runs_on_the_numba_engine_and_equals_the_dense_reference():
    from attnkit_sparse.naive import reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 70, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    attn = attnkit.build(NAME, backend="numba")
    for causal in (False, True):
        out = attn(q, k, v, causal=causal)
        want = reference(attn, q, k, v, mask=causal_mask() if causal else None)
        torch.testing.assert_close(out, want, atol=1e-9, rtol=1e-7)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        wants = torch.autograd.grad(want.square().sum(), (q, k, v))
        for a, b in zip(grads, wants):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


class TestThirdPartyPatternConformance(AttentionConformance):
    name = NAME
    options = {"backend": "numba"}
