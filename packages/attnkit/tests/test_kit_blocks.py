"""The block suite: shapes, causality through the whole block, gradients, state_dict, deepcopy.

The suite builds blocks with ``attnkit.build_block``; the tests against the
real registry skip while this attnkit has no ``build_block``. The suite's own
machinery is tested now through ``registry=``, any object with a
``build_block(name, dim=, num_heads=, attention=, **options)`` method.
"""

from __future__ import annotations

import broken_impls
import pytest

import attnkit
from attnkit.layers import TransformerBlock
from attnkit.testing import BLOCK_CHECKS, BlockConformance, BlockConformanceConfig, run_block_conformance
from attnkit.testing.config import ConformanceConfigError

needs_build_block = pytest.mark.skipif(not hasattr(attnkit, "build_block"),
                                       reason="attnkit.build_block is not available yet (block registry)")


class StubRegistry:
    """Builds the standard pre-norm block by hand, as build_block("pre-norm", ...) will."""

    def build_block(self, name, *, dim, num_heads, attention, **options):
        assert name == "pre-norm", name
        return TransformerBlock(dim, num_heads, attention, **options)


def test_the_block_suite_passes_the_pre_norm_block():
    report = run_block_conformance("pre-norm", registry=StubRegistry())
    assert report.ok, report.format()
    assert [r.check for r in report.passed] == list(BLOCK_CHECKS)


def test_a_leak_in_the_attention_leaks_through_the_block():
    with attnkit.registered(broken_impls.LeakyFutureAttention, name="kit-leaky", exact=True,
                            capabilities=broken_impls.BASIC):
        report = run_block_conformance("pre-norm", registry=StubRegistry(), attention="kit-leaky",
                                       checks=["block_causality", "block_shapes"])
    assert [r.check for r in report.failed] == ["block_causality"]
    assert "leaks the future" in report["block_causality"].message


def test_block_options_pass_through_and_mlp_free_blocks_pass():
    report = run_block_conformance("pre-norm", {"mlp_ratio": 0}, registry=StubRegistry(), length=5)
    assert report.ok, report.format()


def test_without_build_block_the_checks_skip_with_the_reason():
    class NoBlocks:
        pass

    if hasattr(attnkit, "build_block"):
        pytest.skip("attnkit.build_block exists: the fallback is not reachable")
    report = run_block_conformance("pre-norm", registry=NoBlocks())
    assert report.ok and len(report.skipped) == len(BLOCK_CHECKS)
    assert "build_block is not available" in report.results[0].message


def test_block_config_errors_are_loud():
    with pytest.raises(ConformanceConfigError, match="dim % num_heads"):
        BlockConformanceConfig(name="pre-norm", dim=6, num_heads=4)
    with pytest.raises(ConformanceConfigError, match="unknown block check"):
        BlockConformanceConfig(name="pre-norm", skip={"block_shape": "typo"})


class TestStubPreNormBlock(BlockConformance):
    """The pytest face, through the stub registry (runs today)."""

    name = "pre-norm"
    registry = StubRegistry()


@needs_build_block
class TestPreNormBlock(BlockConformance):
    """The registered standard block, built by attnkit.build_block."""

    name = "pre-norm"


@needs_build_block
def test_registered_pre_norm_block_passes():
    report = run_block_conformance("pre-norm")
    assert report.ok, report.format()
