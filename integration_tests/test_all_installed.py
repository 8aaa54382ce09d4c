"""With every package installed and strict loading: all load, every name builds and conforms."""

from __future__ import annotations

import os

import pytest
import torch

import attnkit


def test_strict_loading_is_on_and_nothing_is_broken():
    assert os.environ.get("ATTNKIT_STRICT_PLUGINS") == "1"
    records = attnkit.plugin_records()
    assert all(r.status == "loaded" for r in records), [(r.name, r.error) for r in records]


@pytest.mark.parametrize("name", [s.name for s in attnkit.available()])
def test_every_registered_name_runs_in_a_transformer(name):
    spec = attnkit.get_spec(name)
    causal = not spec.capabilities.noncausal
    torch.manual_seed(0)
    model = attnkit.Transformer(16, depth=1, num_heads=2, attention=name)
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = model(x, causal=causal)
    y.square().mean().backward()
    assert y.shape == (2, 8, 16) and torch.isfinite(x.grad).all()
