"""The block suite: shapes, causality through the whole block, gradients, state_dict, deepcopy, checkpointing,
meta-device init.

The suite builds blocks with ``attnkit.build_block`` (or ``registry=``: any object
with a ``build_block(name, dim=, num_heads=, attention=, **options)`` method).
"""

from __future__ import annotations

import broken_impls
import pytest

import attnkit
from attnkit.layers import TransformerBlock
from attnkit.testing import BLOCK_CHECKS, BlockConformance, BlockConformanceConfig, run_block_conformance
from attnkit.testing.config import ConformanceConfigError


class StubRegistry:
    """Any object with ``build_block`` serves as the suite's registry."""

    def __init__(self):
        self.calls = 0

    def build_block(self, name, *, dim, num_heads, attention, **options):
        self.calls += 1
        return TransformerBlock(dim, num_heads, attention, **options)


def test_the_block_suite_passes_the_registered_pre_norm_block():
    report = run_block_conformance("pre-norm")
    assert report.ok, report.format()
    assert [r.check for r in report.passed] == list(BLOCK_CHECKS)


def test_a_leak_in_the_attention_leaks_through_the_block():
    with attnkit.registered(broken_impls.LeakyFutureAttention, name="kit-leaky", exact=True,
                            capabilities=broken_impls.BASIC):
        report = run_block_conformance("pre-norm", attention="kit-leaky", checks=["block_causality", "block_shapes"])
    assert [r.check for r in report.failed] == ["block_causality"]
    assert "leaks the future" in report["block_causality"].message


def test_a_double_unpack_in_the_attention_fails_block_checkpointing():
    with attnkit.registered(broken_impls.DoubleUnpackAttention, name="kit-double-unpack", exact=True,
                            capabilities=broken_impls.Capabilities(causal=False)):
        report = run_block_conformance("pre-norm", attention="kit-double-unpack",
                                       checks=["block_checkpointing", "block_gradients"])
    assert [r.check for r in report.failed] == ["block_checkpointing"]
    assert "backward raised CheckpointError" in report["block_checkpointing"].message


def test_a_block_whose_reset_leaves_a_buffer_fails_block_meta_init():
    """Built from its class (no recorded options), a block resets its children; an attention whose own
    reset_parameters sets nothing then computes with uninitialised memory."""
    with attnkit.registered(broken_impls.NoOpResetAttention, name="kit-noop-reset", exact=True,
                            capabilities=broken_impls.BASIC):
        report = run_block_conformance("pre-norm", attention="kit-noop-reset", registry=StubRegistry(),
                                       checks=["block_meta_init"])
    assert [r.check for r in report.failed] == ["block_meta_init"]
    assert "state_dict entry 'attn.attention.features'" in report["block_meta_init"].message


def test_block_options_pass_through_and_mlp_free_blocks_pass():
    report = run_block_conformance("pre-norm", {"mlp_ratio": 0}, length=5)
    assert report.ok, report.format()


def test_a_given_registry_builds_the_blocks():
    reg = StubRegistry()
    report = run_block_conformance("pre-norm", registry=reg, checks=["block_shapes"])
    assert report.ok and reg.calls >= 1


def test_block_config_errors_are_loud():
    with pytest.raises(ConformanceConfigError, match="dim % num_heads"):
        BlockConformanceConfig(name="pre-norm", dim=6, num_heads=4)
    with pytest.raises(ConformanceConfigError, match="unknown block check"):
        BlockConformanceConfig(name="pre-norm", skip={"block_shape": "typo"})


class TestPreNormBlock(BlockConformance):
    """The registered standard block, built by attnkit.build_block."""

    name = "pre-norm"

