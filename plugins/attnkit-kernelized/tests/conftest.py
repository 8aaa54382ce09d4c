"""Shared pytest configuration of the kernelized plugin's tests."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "triton: triton kernels on CPU tensors in the interpreter (skipped unless triton is importable and "
        "TRITON_INTERPRET=1 is set before the run)",
    )


@pytest.fixture(autouse=True)
def _busy_mode_off(monkeypatch):
    """Busy-machine mode (``attnkit_kernelized._busy``) off in every test unless the test turns it on: the mode
    reads the machine's load, so beside a second test worker it engaged in some calls and not in others, and each
    test ran whichever path the load chose (and compiled both the team and the hand-out kernels of what it ran).
    The tests of the mode (``test_busy.py``, and the hand-out tests of the fused kernels) choose the path
    themselves."""
    from attnkit_kernelized import _busy

    monkeypatch.setattr(_busy, "_ENABLED", False)
