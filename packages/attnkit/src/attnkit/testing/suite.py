"""The pytest face of the conformance kit: subclass :class:`AttentionConformance`.

.. code-block:: python

    from attnkit.testing import AttentionConformance

    class TestPerformerConformance(AttentionConformance):
        name = "performer"
        options = {"num_features": 64}

pytest collects one ``test_<check>`` method per check of
:data:`attnkit.testing.checks.CHECKS`; a check that does not apply is skipped
with its reason. The checks themselves live in the kit's modules (no pytest;
:mod:`attnkit.testing.checks` lists them), which
:func:`attnkit.testing.run_conformance` also uses. :class:`BlockConformance`
is the same for block-level mechanisms (:mod:`attnkit.testing.blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from .blocks import BLOCK_CHECKS, BlockConformanceConfig
from .checks import (
    CHECKS,
    DEFAULT_LONG_LENGTH,
    DEFAULT_SHAPES,
    DEFAULT_STREAMING_CHUNKS,
    CheckSkipped,
    ConformanceConfig,
    ErrorDistribution,
)

__all__ = ["AttentionConformance", "BlockConformance"]


class AttentionConformance:
    """Base class of a conformance test suite for one registered attention.

    Subclass it in a test module whose class name starts with ``Test``, set
    :attr:`name`, and pytest runs every check against that implementation.

    Class attributes (all optional but :attr:`name`):

    * ``name``: the registered name (alias, ``family/name`` or ``dist:name``).
    * ``options``: extra build options. ``num_heads``/``head_dim`` are passed
      from ``shapes`` automatically when the factory takes them.
    * ``dtypes_to_test``: dtypes (names or torch dtypes); default every
      declared dtype.
    * ``atol`` / ``rtol``: ``{dtype: tolerance}`` overrides of the defaults.
    * ``shapes``: ``(B, H, L, S, D, E)``; self-attention uses L keys,
      cross-attention S keys (B >= 2, L >= 4, S != L).
    * ``gradcheck_shapes``: ``(B, H, L, S, D, E)`` for gradcheck; default
      ``shapes`` with B = 1.
    * ``error_distribution``: an :class:`~attnkit.testing.ErrorDistribution`
      (or a dict of its fields) for the ``error_bound`` check.
    * ``long_length``: the longer self-attention length of the reference cases
      (default 67; None leaves it out).
    * ``streaming_chunks``: chunk sizes for streaming (None = whole sequence).
    * ``queries_interact``: True when queries influence each other's outputs
      (skips ``nan_queries``).
    * ``skip``: ``{check_name: reason}``; e.g. ``{"gradcheck": "top-k is not differentiable"}``.
    * ``device``: default ``"cpu"``; ``seed``: default 0; ``registry``: the
      registry holding ``name`` (default: the process-wide one).
    * ``streaming_reference(self, attn, q, k, v, chunk)``: define it for
      ``streaming="segment"`` to return the expected concatenated step outputs
      ``(B, H, L, E)`` (or None).
    """

    name: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Any]] = {}
    dtypes_to_test: ClassVar[Sequence[str | torch.dtype] | None] = None
    atol: ClassVar[Mapping[str | torch.dtype, float]] = {}
    rtol: ClassVar[Mapping[str | torch.dtype, float]] = {}
    shapes: ClassVar[Sequence[int]] = DEFAULT_SHAPES
    gradcheck_shapes: ClassVar[Sequence[int] | None] = None
    long_length: ClassVar[int | None] = DEFAULT_LONG_LENGTH
    error_distribution: ClassVar[ErrorDistribution | Mapping[str, Any]] = ErrorDistribution()
    streaming_chunks: ClassVar[Sequence[int | None]] = DEFAULT_STREAMING_CHUNKS
    queries_interact: ClassVar[bool] = False
    skip: ClassVar[Mapping[str, str]] = {}
    device: ClassVar[str] = "cpu"
    seed: ClassVar[int] = 0
    registry: ClassVar[Any] = None
    streaming_reference: ClassVar[Callable[..., Tensor | None] | None] = None

    def conformance_config(self) -> ConformanceConfig:
        """The :class:`~attnkit.testing.ConformanceConfig` built from the class attributes."""
        if not self.name:
            raise TypeError(
                f"{type(self).__name__}: set the class attribute name = '<registered attention name>'"
            )
        return ConformanceConfig(
            name=self.name,
            options=dict(self.options),
            dtypes=self.dtypes_to_test,
            atol=dict(self.atol),
            rtol=dict(self.rtol),
            shapes=tuple(self.shapes),
            gradcheck_shapes=self.gradcheck_shapes,
            long_length=self.long_length,
            error_distribution=self.error_distribution,
            streaming_chunks=tuple(self.streaming_chunks),
            streaming_reference=self.streaming_reference,
            queries_interact=self.queries_interact,
            skip=dict(self.skip),
            device=self.device,
            seed=self.seed,
            registry=self.registry,
        )

    def run_check(self, check: str) -> None:
        """Run one check; skips (configured or not applicable) become ``pytest.skip``."""
        __tracebackhide__ = True
        cfg = self.conformance_config()
        if check in cfg.skip:
            pytest.skip(f"{check}: skipped by configuration: {cfg.skip[check]}")
        try:
            CHECKS[check](cfg)
        except CheckSkipped as exc:
            pytest.skip(f"{check}: {exc}")

    # One test per check; docstrings say what each one proves.
    def test_shapes_dtypes(self) -> None:
        """Output (B, H, L, E), input dtype and device, finite; inputs not modified."""
        self.run_check("shapes_dtypes")

    def test_layouts(self) -> None:
        """Transposed (non-contiguous) and head-expanded (stride 0) inputs give what contiguous ones give."""
        self.run_check("layouts")

    def test_refusals(self) -> None:
        """Undeclared capabilities, mask kinds, positions, streaming, limits and dtypes are refused."""
        self.run_check("refusals")

    def test_causality(self) -> None:
        """causal=True: perturbing future q/k/v changes no past output."""
        self.run_check("causality")

    def test_key_padding(self) -> None:
        """Padded keys count as absent: equal to the output with them removed; zero gradients there."""
        self.run_check("key_padding")

    def test_fully_masked_rows(self) -> None:
        """A row that sees no key gives zeros, never NaN, with finite gradients."""
        self.run_check("fully_masked_rows")

    def test_attn_mask(self) -> None:
        """A declared attn_mask is honoured: masked-out pairs have no influence."""
        self.run_check("attn_mask")

    def test_mask_objects(self) -> None:
        """Mask objects (windows, documents, functions, unions) are honoured; shorthands agree."""
        self.run_check("mask_objects")

    def test_cross_attention(self) -> None:
        """A declared L != S works (both L < S and L > S)."""
        self.run_check("cross_attention")

    def test_batch_independence(self) -> None:
        """Batch elements do not interact."""
        self.run_check("batch_independence")

    def test_reference(self) -> None:
        """Forward and gradients equal the spec's reference in float64, on every backend here."""
        self.run_check("reference")

    def test_error_bound(self) -> None:
        """The error vs softmax (a figure) stays within a declared spec.error_bound."""
        self.run_check("error_bound")

    def test_scaled_inputs(self) -> None:
        """Approximate specs: q, k scaled by 10/30/100 give finite, non-zero rows close to the spec's reference."""
        self.run_check("scaled_inputs")

    def test_streaming(self) -> None:
        """step and forward(state=..., return_state=True) equal the causal forward, with gradients."""
        self.run_check("streaming")

    def test_state_validation(self) -> None:
        """States of another batch, dtype, device, mechanism or configuration are refused."""
        self.run_check("state_validation")

    def test_backends(self) -> None:
        """Every backend that can run here agrees with the torch path, forward and backward."""
        self.run_check("backends")

    def test_gradients(self) -> None:
        """Gradients are finite; padded keys get zero gradient."""
        self.run_check("gradients")

    def test_training_mode(self) -> None:
        """In training mode (noise, redraws, batch-updated buffers) outputs and gradients are finite."""
        self.run_check("training_mode")

    def test_inference_mode(self) -> None:
        """A call under torch.inference_mode equals a no_grad call, and the instance trains after it."""
        self.run_check("inference_mode")

    def test_autocast(self) -> None:
        """Under torch.autocast: the inputs cast once to its dtype (as SDPA), float32 gradients."""
        self.run_check("autocast")

    def test_gradcheck(self) -> None:
        """torch.autograd.gradcheck passes in float64 on tiny shapes."""
        self.run_check("gradcheck")

    def test_double_backward(self) -> None:
        """Second derivatives (create_graph=True, then differentiated) are right or refused, never wrong."""
        self.run_check("double_backward")

    def test_aux_losses(self) -> None:
        """Declared auxiliary losses: recorded in the graph, tied to the forward's output."""
        self.run_check("aux_losses")

    def test_func_transforms(self) -> None:
        """Declared torch.func transforms (grad, vmap, jvp) give autograd's / a loop's results; others are refused."""
        self.run_check("func_transforms")

    def test_meta_init(self) -> None:
        """Built on the meta device, to_empty + reset_parameters() under a seed equals a seeded build."""
        self.run_check("meta_init")

    def test_export(self) -> None:
        """torch.export: the program equals eager on other inputs and mask inputs it declares; the rest refused."""
        self.run_check("export")

    def test_export_dynamic(self) -> None:
        """torch.export with a dynamic length: declared backends' programs equal eager at other lengths."""
        self.run_check("export_dynamic")

    def test_checkpointing(self) -> None:
        """Training steps under torch.utils.checkpoint (non-reentrant) equal the plain steps."""
        self.run_check("checkpointing")

    def test_state_dict(self) -> None:
        """state_dict round-trips into a freshly built instance."""
        self.run_check("state_dict")

    def test_serialisation(self) -> None:
        """deepcopy, pickle and torch.save of the whole module keep its outputs."""
        self.run_check("serialisation")

    def test_determinism(self) -> None:
        """Same seed, same outputs; same instance, same output twice."""
        self.run_check("determinism")

    def test_empty_sequences(self) -> None:
        """L = 0 and S = 0: empty in, empty (or zero) out, backward works, on every backend."""
        self.run_check("empty_sequences")

    def test_padded_values(self) -> None:
        """1e4, NaN and +/-inf at padded keys change nothing, on every backend."""
        self.run_check("padded_values")

    def test_nan_queries(self) -> None:
        """A NaN query gives NaN in its own row only."""
        self.run_check("nan_queries")

    def test_fuzz(self) -> None:
        """Random shapes, dtypes, padding, masks and options: a clear refusal or the reference (hypothesis)."""
        self.run_check("fuzz")


class BlockConformance:
    """Base class of a conformance test suite for one registered block (``attnkit.build_block``).

    Subclass it (class name starting with ``Test``) and set :attr:`name`;
    pytest runs every block check. Optional class attributes: ``options``,
    ``attention`` (default ``"softmax"``), ``dim``, ``num_heads``, ``batch``,
    ``length``, ``dtype`` (default float64), ``atol``, ``rtol``, ``skip``,
    ``device``, ``seed``, ``registry``. Checks skip while this attnkit has no
    ``build_block``.
    """

    name: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Any]] = {}
    attention: ClassVar[str] = "softmax"
    dim: ClassVar[int] = 8
    num_heads: ClassVar[int] = 2
    batch: ClassVar[int] = 2
    length: ClassVar[int] = 9
    dtype: ClassVar[str] = "float64"
    atol: ClassVar[Mapping[str | torch.dtype, float]] = {}
    rtol: ClassVar[Mapping[str | torch.dtype, float]] = {}
    skip: ClassVar[Mapping[str, str]] = {}
    device: ClassVar[str] = "cpu"
    seed: ClassVar[int] = 0
    registry: ClassVar[Any] = None

    def block_config(self) -> BlockConformanceConfig:
        if not self.name:
            raise TypeError(f"{type(self).__name__}: set the class attribute name = '<registered block name>'")
        return BlockConformanceConfig(
            name=self.name, options=dict(self.options), attention=self.attention, dim=self.dim,
            num_heads=self.num_heads, batch=self.batch, length=self.length, dtype=self.dtype,
            atol=dict(self.atol), rtol=dict(self.rtol), skip=dict(self.skip), device=self.device,
            seed=self.seed, registry=self.registry)

    def run_check(self, check: str) -> None:
        __tracebackhide__ = True
        cfg = self.block_config()
        if check in cfg.skip:
            pytest.skip(f"{check}: skipped by configuration: {cfg.skip[check]}")
        try:
            BLOCK_CHECKS[check](cfg)
        except CheckSkipped as exc:
            pytest.skip(f"{check}: {exc}")

    def test_block_shapes(self) -> None:
        """(B, L, dim) in and out, input dtype, finite; input not modified."""
        self.run_check("block_shapes")

    def test_block_causality(self) -> None:
        """causal=True through the whole block: perturbing future x changes no past output."""
        self.run_check("block_causality")

    def test_block_gradients(self) -> None:
        """Gradients of x and parameters are finite."""
        self.run_check("block_gradients")

    def test_block_state_dict(self) -> None:
        """state_dict round-trips into a block built under another seed."""
        self.run_check("block_state_dict")

    def test_block_deepcopy(self) -> None:
        """A deep copy gives the same outputs."""
        self.run_check("block_deepcopy")

    def test_block_checkpointing(self) -> None:
        """A training step under torch.utils.checkpoint (non-reentrant) equals the plain step."""
        self.run_check("block_checkpointing")

    def test_block_meta_init(self) -> None:
        """Built on the meta device, to_empty + reset_parameters() under a seed equals a seeded build."""
        self.run_check("block_meta_init")
