"""Shared pytest configuration of the kernelized plugin's tests."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "triton: triton kernels, run under TRITON_INTERPRET=1 on CPU tensors (skipped when triton is not importable)",
    )
