"""``Capabilities.shared_qk``: MultiHeadAttention builds no key projection and passes k = q."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import InvalidInputError, MultiHeadAttention


class _SeesK(attnkit.Attention):
    """Records the k it was given; softmax attention otherwise."""

    def _attend(self, q, k, v, ctx):
        self.seen = (q, k)
        return torch.softmax(q @ k.transpose(-1, -2) * ctx.scale, -1) @ v


@pytest.fixture
def shared_name():
    caps = attnkit.Capabilities(causal=False, cross=False, shared_qk=True)
    with attnkit.registered(_SeesK, name="test-shared-qk", family="custom", capabilities=caps):
        yield "test-shared-qk"


def test_capability_defaults_to_false():
    assert attnkit.Capabilities().shared_qk is False
    assert attnkit.get_spec("softmax").capabilities.shared_qk is False


def test_shared_qk_layer_has_no_key_projection_and_passes_q_as_k(shared_name):
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, shared_name)
    assert mha.k_proj is None
    assert not any(name.startswith("k_proj") for name, _ in mha.named_parameters())
    n_plain = sum(p.numel() for p in MultiHeadAttention(8, 2).parameters())
    assert sum(p.numel() for p in mha.parameters()) == n_plain - (8 * 8 + 8)
    x = torch.randn(2, 5, 8)
    y = mha(x)
    q, k = mha.attention.seen
    assert k is q
    assert y.shape == (2, 5, 8)
    y.sum().backward()  # the graph reaches q_proj twice (as q and as k)
    assert mha.q_proj.weight.grad is not None


def test_shared_qk_layer_refuses_context(shared_name):
    mha = MultiHeadAttention(8, 2, shared_name)
    with pytest.raises(InvalidInputError, match="context"):
        mha(torch.randn(1, 3, 8), torch.randn(1, 3, 8))


def test_plain_layer_keeps_its_key_projection():
    mha = MultiHeadAttention(8, 2)
    assert isinstance(mha.k_proj, torch.nn.Linear)
