"""The built-in exact softmax passes the conformance kit, as a third party would run it."""

from __future__ import annotations

from attnkit.testing import AttentionConformance


class TestSoftmax(AttentionConformance):
    """Automatic dispatch (SDPA on CPU); the backends check compares it with the torch path."""

    name = "softmax"


class TestSoftmaxTorchBackend(AttentionConformance):
    """The readable naive path, forced."""

    name = "softmax"
    options = {"backend": "torch"}
