"""Bad input: each error names the option (or input), what was expected and what was given."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit.masks import from_function
from attnkit.registry import default_registry

q = k = v = torch.randn(1, 2, 9, 4)


@pytest.mark.parametrize("name,option,value", [
    ("local", "window", 0), ("dilated", "window", 0), ("dilated", "dilation", 0), ("global", "window", -1),
    ("longformer", "window", 0), ("block-local", "block_size", 0), ("random", "block_size", 0),
    ("random", "num_random", 0), ("bigbird", "block_size", 0), ("strided", "stride", 0), ("fixed", "stride", 0),
    ("fixed", "c", 0), ("bp-transformer", "k", 0),
])
def test_sizes_below_one(name, option, value):
    with pytest.raises(InvalidInputError, match=rf"{option}: expected (a value|an int) >= 1, got {value}"):
        attnkit.build(name, **{option: value})
    factory = default_registry().resolve(name).load_factory()
    with pytest.raises(InvalidInputError, match=rf"{option}: expected an int >= 1, got {value}"):
        factory(**{option: value})  # the constructor checks again (built without the registry)


def test_constructor_checks_without_the_registry():
    from attnkit_sparse.patterns import BlockLocalAttention, LocalAttention
    with pytest.raises(InvalidInputError, match=r"window: expected an int >= 1, got 0"):
        LocalAttention(window=0)
    with pytest.raises(InvalidInputError, match=r"block_size: expected an int >= 1, got 0"):
        BlockLocalAttention(block_size=0)
    with pytest.raises(InvalidInputError, match=r"window: expected an int >= 1, got 2.5"):
        LocalAttention(window=2.5)


def test_fixed_c_above_stride_and_even_bigbird_window():
    with pytest.raises(InvalidInputError, match=r"c: expected an int in \[1, stride\] = \[1, 4\].*got 5"):
        attnkit.build("fixed", stride=4, c=5)
    with pytest.raises(InvalidInputError, match=r"num_window: expected an odd int >= 1.*got 4"):
        attnkit.build("bigbird", num_window=4)


@pytest.mark.parametrize("name", ["global", "longformer"])
def test_global_positions(name):
    with pytest.raises(InvalidInputError, match=r"global_positions: expected distinct positions, got \[3\] more"):
        attnkit.build(name, global_positions=[0, 3, 3])
    with pytest.raises(InvalidInputError, match=r"global_positions: expected positions that are ints >= 0, got -1"):
        attnkit.build(name, global_positions=[-1])
    with pytest.raises(InvalidInputError, match=r"num_global / global_positions: give one of them"):
        attnkit.build(name, num_global=2, global_positions=[0])
    attn = attnkit.build(name, global_positions=[0, 12])
    # a limit of the instance (as a grid's length): the forward refuses the length, the pattern the positions
    with pytest.raises(UnsupportedFeatureError, match=r"L=9, S=9: beyond its limit \(global_positions: the global "
                                                       r"position 12 needs at least 13 keys"):
        attn(q, k, v)
    assert attn.limits.why_not(13, 13) is None and attn.limits.why_not(20, 12) is not None
    with pytest.raises(InvalidInputError, match=r"global_positions: expected positions in \[0, 9\).*got \[12\] out"):
        attn.pattern_mask(9, 9)


@pytest.mark.parametrize("name", ["local-2d", "axial"])
def test_grid_that_does_not_match_the_length(name):
    attn = attnkit.build(name, grid=(2, 4))
    with pytest.raises(UnsupportedFeatureError, match=r"grid=\(2, 4\) holds rows x cols = 8 positions: L and S must be "
                                                       r"8, got L=9, S=9"):
        attn(q, k, v)
    with pytest.raises(InvalidInputError, match=r"grid: grid=\(2, 4\) holds .* got L=9"):
        attn.pattern_mask(9, 9)
    with pytest.raises(InvalidInputError, match=r"grid\[1\] \(cols\): expected an int >= 1, got 0"):
        attnkit.build(name, grid=(3, 0))
    assert attn(q[:, :, :8], k[:, :, :8], v[:, :, :8]).shape == (1, 2, 8, 4)


def test_causal_for_a_pattern_without_a_causal_form_lists_those_with_one():
    attn = attnkit.build("bigbird")
    with pytest.raises(UnsupportedFeatureError, match=r"'bigbird' does not support causal=True: BigBird-ITC has no "
                                                       r"causal form.*with a causal form: local, dilated, block-local"):
        attn(q, k, v, causal=True)
    with pytest.raises(UnsupportedFeatureError, match="no causal form"):
        attn.pattern_mask(9, 9, causal=True)


def test_a_mask_function_that_raises_or_returns_non_bool_surfaces_through_block_sparse():
    attn = attnkit.build("block-sparse")

    def boom(b, h, qp, kp):
        raise RuntimeError("bad pattern")

    with pytest.raises(InvalidInputError, match=r"mask function 'boom' raised RuntimeError: bad pattern"):
        attn(q, k, v, mask=from_function(boom))
    with pytest.raises(InvalidInputError, match=r"mask function 'ints' must return a bool tensor.*got a torch.int64"):
        attn(q, k, v, mask=from_function(lambda b, h, qp, kp: qp - kp, name="ints"))


def test_other_bad_options():
    with pytest.raises(InvalidInputError, match=r"axis: expected one of \['both', 'row', 'column'\], got 'diag'"):
        attnkit.build("axial", axis="diag")
    from attnkit_sparse.patterns import StridedAttention
    with pytest.raises(InvalidInputError, match=r"heads: expected 'merged' .* or 'split' .*, got 'both'"):
        StridedAttention(heads="both")
    with pytest.raises(InvalidInputError, match=r"option heads: expected one of \['merged', 'split'\], got 'x'"):
        attnkit.build("fixed", heads="x")
    with pytest.raises(InvalidInputError, match=r"option backend: expected one of"):
        attnkit.build("local", backend="cuda")
    attn = attnkit.build("dilated", window=2, dilation=[1, 2, 3])
    with pytest.raises(InvalidInputError, match=r"expected one dilation per head \(H = 2\), got 3 values"):
        attn(q, k, v)
