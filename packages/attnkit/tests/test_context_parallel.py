"""Context parallelism in the core: the capability, refusals, the collectives, and the checker.

Toy attentions (elementwise, D = E) stand for the two kinds of split form: a
running sum passed as an exclusive prefix over ranks, and a window of past
keys received as a halo. Broken variants (the prefix dropped, the halo one
position short) prove the checker catches them.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.context_parallel import ContextParallel, chunk_bounds, context_parallel
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit.testing.context_parallel import run_cases

_CAPS = attnkit.Capabilities(causal=True, noncausal=False, cross=False, key_padding_mask=True,
                             context_parallel=True, dtypes=("float32", "float64"))


class ToyPrefix(attnkit.Attention):
    """``out_i = q_i * sum_{j <= i} k_j * v_j`` (elementwise): a running sum, split as an exclusive prefix."""

    capabilities = _CAPS
    drop_prefix = False

    def _attend(self, q, k, v, ctx):
        return q * torch.cumsum(k * v, dim=2)

    def _context_parallel(self, q, k, v, cp: ContextParallel):
        summaries = cp.gather([(k * v).sum(dim=2)])
        prefix = cp.exclusive_prefix(summaries, lambda a, b: [a[0] + b[0]])
        run = torch.cumsum(k * v, dim=2)
        if prefix is not None and not self.drop_prefix:
            run = run + prefix[0].unsqueeze(2)
        return q * run


class ToyPrefixBroken(ToyPrefix):
    drop_prefix = True


class ToyHalo(attnkit.Attention):
    """``out_i = q_i * sum_{i - W < j <= i} k_j * v_j``: a window of past keys, split with a halo."""

    capabilities = _CAPS
    window = 3
    short = 0

    def _attend(self, q, k, v, ctx):
        c = torch.cumsum(k * v, dim=2)
        lag = torch.nn.functional.pad(c, (0, 0, self.window, 0))[:, :, : c.shape[2]]
        return q * (c - lag)

    def _context_parallel(self, q, k, v, cp: ContextParallel):
        hk, hv = cp.halo([k, v], self.window - 1 - self.short)
        L, n = q.shape[2], hk.shape[2]
        full = self._attend(torch.cat([hk, q], dim=2) if n else q,
                            torch.cat([hk, k], dim=2) if n else k, torch.cat([hv, v], dim=2) if n else v, None)
        return full[:, :, n:n + L] if n else full


class ToyHaloOffByOne(ToyHalo):
    short = 1


HERE = __name__


def test_capability_defaults_to_false_and_filters():
    assert attnkit.Capabilities().context_parallel is False
    assert attnkit.get_spec("softmax").capabilities.context_parallel is False
    with attnkit.registered(ToyPrefix, name="toy-cp", family="test"):
        assert "toy-cp" in [s.name for s in attnkit.available(context_parallel=True)]
        assert "softmax" not in [s.name for s in attnkit.available(context_parallel=True)]


def test_refusal_names_the_implementations_that_can():
    q = torch.randn(1, 1, 4, 2)
    with attnkit.registered(ToyPrefix, name="toy-cp", family="test"):
        with pytest.raises(UnsupportedFeatureError, match="context parallelism") as info:
            context_parallel(attnkit.build("softmax"), q, q, q)
    assert "toy-cp" in info.value.supported_by
    assert "softmax" in str(info.value)


def test_refuses_noncausal_and_needs_an_initialised_group():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(UnsupportedFeatureError, match="causal=False"):
        context_parallel(ToyPrefix(), q, q, q, causal=False)
    with pytest.raises(InvalidInputError, match="init_process_group"):
        context_parallel(ToyPrefix(), q, q, q)


def test_bad_chunks_are_refused_before_any_collective():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(InvalidInputError, match="q and k"):
        context_parallel(ToyPrefix(), q, torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2))
    with pytest.raises(InvalidInputError, match="key_padding_mask"):
        context_parallel(ToyPrefix(), q, q, q, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(InvalidInputError, match="attnkit.Attention"):
        context_parallel(torch.nn.Identity(), q, q, q)


def test_chunk_bounds_cover_the_sequence_evenly():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_split_forms_match_one_process_and_broken_ones_are_caught():
    """One spawned world of 3 gloo ranks with uneven chunks (1, 4, 2: the halo of the last rank spans two
    earlier ranks), padding with NaN/Inf: the correct toys match to 1e-9 in outputs and gradients; a dropped
    prefix and a halo one position short do not."""
    results = run_cases([(f"{HERE}:ToyPrefix", {}), (f"{HERE}:ToyHalo", {}),
                         (f"{HERE}:ToyPrefixBroken", {}), (f"{HERE}:ToyHaloOffByOne", {})],
                        world=3, lengths=[1, 4, 2], shape=(2, 2, 3, 3))
    status = {r.target.split(":")[1]: r for r in results}
    assert status["ToyPrefix"].status == "ok", status["ToyPrefix"]
    assert status["ToyHalo"].status == "ok", status["ToyHalo"]
    assert status["ToyPrefixBroken"].status == "mismatch" and status["ToyPrefixBroken"].errors["out"] > 1e-3
    assert status["ToyHaloOffByOne"].status == "mismatch" and status["ToyHaloOffByOne"].errors["out"] > 1e-3
    # the gradient of a key on an early rank comes back from the later ranks that used it
    assert status["ToyHalo"].errors["dk"] <= 1e-9 and status["ToyPrefix"].errors["dv"] <= 1e-9


def test_sequence_parallel_routes_multihead_attention_and_refuses_what_cannot_split():
    from attnkit.context_parallel import active_group, sequence_parallel

    assert active_group() is None
    x = torch.randn(1, 4, 8)
    mha = attnkit.MultiHeadAttention(8, 2, "softmax")
    with sequence_parallel():
        assert active_group() == [None]
        with pytest.raises(UnsupportedFeatureError, match="context parallelism"):
            mha(x, causal=True)                      # routed to context_parallel: softmax cannot split
        with pytest.raises(InvalidInputError, match="positions"):
            mha(x, causal=True, positions=3)
    assert active_group() is None
    assert mha(x, causal=True).shape == (1, 4, 8)    # outside the block: the plain forward
