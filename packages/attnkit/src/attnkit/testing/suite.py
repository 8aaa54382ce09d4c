"""The pytest face of the conformance kit: subclass :class:`AttentionConformance`.

.. code-block:: python

    from attnkit.testing import AttentionConformance

    class TestPerformerConformance(AttentionConformance):
        name = "performer"
        options = {"num_features": 64}

pytest collects one ``test_<check>`` method per check of
:data:`attnkit.testing.checks.CHECKS`; a check that does not apply is skipped
with its reason. The checks themselves live in :mod:`attnkit.testing.checks`
(no pytest), which :func:`attnkit.testing.run_conformance` also uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from .checks import (
    CHECKS,
    DEFAULT_SHAPES,
    DEFAULT_STREAMING_CHUNKS,
    CheckSkipped,
    ConformanceConfig,
    ErrorDistribution,
)

__all__ = ["AttentionConformance"]


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
    * ``streaming_chunks``: chunk sizes for streaming (None = whole sequence).
    * ``skip``: ``{check_name: reason}``; e.g. ``{"gradcheck": "top-k is not differentiable"}``.
    * ``device``: default ``"cpu"``; ``seed``: default 0.
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
    error_distribution: ClassVar[ErrorDistribution | Mapping[str, Any]] = ErrorDistribution()
    streaming_chunks: ClassVar[Sequence[int | None]] = DEFAULT_STREAMING_CHUNKS
    skip: ClassVar[Mapping[str, str]] = {}
    device: ClassVar[str] = "cpu"
    seed: ClassVar[int] = 0
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
            error_distribution=self.error_distribution,
            streaming_chunks=tuple(self.streaming_chunks),
            streaming_reference=self.streaming_reference,
            skip=dict(self.skip),
            device=self.device,
            seed=self.seed,
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

    def test_refusals(self) -> None:
        """Undeclared capabilities and dtypes raise UnsupportedFeatureError."""
        self.run_check("refusals")

    def test_causality(self) -> None:
        """causal=True: perturbing future q/k/v changes no past output."""
        self.run_check("causality")

    def test_key_padding(self) -> None:
        """Padded keys have no influence on any output."""
        self.run_check("key_padding")

    def test_fully_masked_rows(self) -> None:
        """A row that sees no key gives zeros, never NaN, with finite gradients."""
        self.run_check("fully_masked_rows")

    def test_attn_mask(self) -> None:
        """A declared attn_mask is honoured: masked-out pairs have no influence."""
        self.run_check("attn_mask")

    def test_cross_attention(self) -> None:
        """A declared L != S works (both L < S and L > S)."""
        self.run_check("cross_attention")

    def test_batch_independence(self) -> None:
        """Batch elements do not interact."""
        self.run_check("batch_independence")

    def test_reference(self) -> None:
        """Exact implementations match the float64 reference within per-dtype tolerances."""
        self.run_check("reference")

    def test_error_bound(self) -> None:
        """Approximations stay within spec.error_bound on the stated distribution."""
        self.run_check("error_bound")

    def test_streaming(self) -> None:
        """init_state/step in chunks of 1, 3, all equal the causal forward (exact streaming)."""
        self.run_check("streaming")

    def test_backends(self) -> None:
        """Every backend that can run here agrees with the torch path, forward and backward."""
        self.run_check("backends")

    def test_gradients(self) -> None:
        """Gradients are finite; padded keys get zero gradient."""
        self.run_check("gradients")

    def test_gradcheck(self) -> None:
        """torch.autograd.gradcheck passes in float64 on tiny shapes."""
        self.run_check("gradcheck")

    def test_state_dict(self) -> None:
        """state_dict round-trips into a freshly built instance."""
        self.run_check("state_dict")

    def test_determinism(self) -> None:
        """Same seed, same outputs; same instance, same output twice."""
        self.run_check("determinism")
