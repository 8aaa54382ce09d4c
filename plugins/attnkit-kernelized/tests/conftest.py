"""Shared pytest configuration of the kernelized plugin's tests."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "triton: triton kernels on CPU tensors in the interpreter (skipped unless triton is importable and "
        "TRITON_INTERPRET=1 is set before the run)",
    )
