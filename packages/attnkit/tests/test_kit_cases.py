"""The kit's one case generator: what it yields for which capabilities."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Capabilities, Limits
from attnkit.masks import MASK_KINDS
from attnkit.testing import DEFAULT_LONG_LENGTH, DEFAULT_SHAPES, generate_cases
from attnkit.testing.cases import FAMILIES

B, H, L, S, _, _ = DEFAULT_SHAPES


def cases(caps, **kw):
    return generate_cases(caps, B=B, H=H, L=L, S=S, long_length=DEFAULT_LONG_LENGTH, **kw)


def test_lengths_are_multiples_of_no_block_size():
    every = cases(attnkit.get_spec("softmax").capabilities)
    lengths = {n for c in every for n in (c.L, c.S)}
    assert lengths == {L, S, DEFAULT_LONG_LENGTH}
    assert all(n % b for n in lengths for b in (8, 16, 64))
    assert DEFAULT_LONG_LENGTH > 64  # meets a second 64-block, ragged


def test_softmax_gets_every_mask_kind_mode_and_shape():
    every = cases(attnkit.get_spec("softmax").capabilities)
    assert {k for c in every for k in c.kinds} == set(MASK_KINDS)
    assert {c.causal for c in every} == {False, True}
    assert {(c.L, c.S) for c in every} == {(L, L), (L, S), (S, L), (DEFAULT_LONG_LENGTH,) * 2}
    assert {c.family for c in every} == set(FAMILIES)
    labels = [c.describe() for c in every]
    assert len(labels) == len(set(labels)), "case labels must be unique"


def test_only_declared_mask_kinds_and_modes():
    caps = Capabilities(noncausal=False, cross=False, mask_kinds=("causal", "key_padding", "sliding_window"))
    every = cases(caps)
    assert every and all(c.causal for c in every)
    assert all(c.kinds <= {"causal", "key_padding", "sliding_window"} for c in every)
    assert any("sliding_window" in c.kinds for c in every)
    assert all(c.L == c.S for c in every)  # no cross declared


def test_cross_follows_the_capabilities():
    both = cases(Capabilities(causal_cross=True), families=["cross"])
    assert {(c.L, c.S, c.causal) for c in both} == {(L, S, False), (S, L, False), (L, S, True), (S, L, True)}
    no_causal_cross = cases(Capabilities(), families=["cross"])
    assert all(not c.causal for c in no_causal_cross)
    assert cases(Capabilities(cross=False), families=["cross"]) == []


def test_limits_leave_cases_out():
    every = cases(attnkit.get_spec("softmax").capabilities, limits=Limits(length_multiple=3))
    assert every and all(c.L % 3 == 0 and c.S % 3 == 0 for c in every)
    assert all(c.L == c.S for c in cases(Capabilities(), limits=Limits(equal_length=True)))


def test_case_kwargs_cast_additive_masks_and_resolve_one_mask():
    every = cases(attnkit.get_spec("softmax").capabilities, families=["tensor"])
    additive = [c for c in every if c.kw["attn_mask"].is_floating_point()]
    assert additive
    for c in additive:
        assert c.kwargs(torch.float16)["attn_mask"].dtype == torch.float16
        assert c.kw["attn_mask"].dtype == torch.float64  # the case itself is untouched
        m = c.mask(torch.float64)
        assert isinstance(m, attnkit.masks.Mask) and "tensor" in m.kinds


def test_unknown_family_is_an_error():
    with pytest.raises(ValueError, match="unknown case families"):
        cases(Capabilities(), families=["everything"])
