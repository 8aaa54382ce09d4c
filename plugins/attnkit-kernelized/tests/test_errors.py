"""Bad input gets a clear error naming the argument, what was expected and what was given."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.errors import BackendUnavailableError, InvalidInputError, UnsupportedFeatureError

NAMES = ["linear", "performer", "rfa", "fast-weight"]


def _build(name, **opts):
    return attnkit.build(name, **{"num_heads": 2, "head_dim": 8, **opts})


@pytest.mark.parametrize("name", NAMES)
def test_causal_with_l_different_from_s(name):
    attn = _build(name)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8)
    with pytest.raises(UnsupportedFeatureError) as exc:
        attn(q, k, k, causal=True)
    msg = str(exc.value)
    assert name in msg and "causal=True" in msg and "L=5" in msg and "S=7" in msg


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mask", [torch.ones(6, 6, dtype=torch.bool), torch.zeros(1, 1, 6, 6)])
def test_attn_mask_is_refused(name, mask):
    attn = _build(name)
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(UnsupportedFeatureError) as exc:
        attn(q, q, q, causal=True, attn_mask=mask)
    msg = str(exc.value)
    assert name in msg and "attn_mask" in msg and "key_padding_mask" in msg
    assert "expected attn_mask=None" in msg and f"shape {tuple(mask.shape)}" in msg and str(mask.dtype) in msg
    assert "softmax" in msg           # names an implementation that does support it


@pytest.mark.parametrize("name", ["performer", "rfa"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True])
def test_feature_count_below_one(name, bad):
    with pytest.raises(InvalidInputError) as exc:
        _build(name, num_features=bad)
    msg = str(exc.value)
    assert "num_features" in msg and ">= 1" in msg and repr(bad) in msg


@pytest.mark.parametrize("name", NAMES)
def test_head_dim_differs_from_the_features(name):
    attn = _build(name, head_dim=16)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(InvalidInputError) as exc:
        attn(q, q, q, causal=True)
    msg = str(exc.value)
    assert "head_dim=16" in msg and "got 8" in msg
    if attn.caps.streaming:
        with pytest.raises(InvalidInputError, match="head_dim=16"):
            attn.step(q, q, q, attn.init_state(1))


@pytest.mark.parametrize("name", ["performer", "rfa", "fast-weight"])
def test_head_dim_is_required(name):
    with pytest.raises(InvalidInputError, match="head_dim: expected"):
        attnkit.build(name, num_heads=2)


def test_fast_weight_is_causal_only():
    attn = _build("delta")
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(UnsupportedFeatureError, match="causal=False"):
        attn(q, q, q)


@pytest.mark.parametrize("name,opts,arg", [
    ("linear", {"feature_map": "tanh"}, "feature_map"),
    ("performer", {"feature_map": "softmax"}, "feature_map"),
    ("rfa", {"feature_map": "relu"}, "feature_map"),
    ("fast-weight", {"feature_map": "cosine"}, "feature_map"),
    ("linear", {"chunk_size": 0}, "chunk_size"),
    ("performer", {"redraw_interval": 0}, "redraw_interval"),
    ("performer", {"seed": 1.5}, "seed"),
    ("rfa", {"sigma": -1.0}, "sigma"),
    ("rfa", {"gate_init": 1.0}, "gate_init"),
    ("fast-weight", {"beta": 1.5}, "beta"),
    ("linear", {"dpfp_nu": 2}, "dpfp_nu"),
    ("linear", {"feature_map": "dpfp", "dpfp_nu": 0}, "dpfp_nu"),
])
def test_bad_options_name_the_argument(name, opts, arg):
    with pytest.raises(InvalidInputError) as exc:
        _build(name, **opts)
    msg = str(exc.value)
    assert msg.startswith(arg) or f" {arg}" in msg or f"{arg}:" in msg
    assert "expected" in msg and "got" in msg


def test_wrong_head_count_for_per_head_parameters():
    attn = _build("rfa")
    q = torch.randn(1, 3, 5, 8)
    with pytest.raises(InvalidInputError, match="num_heads=2.*got H=3"):
        attn(q, q, q, causal=True)


def test_step_with_a_foreign_state():
    attn = _build("performer", num_features=4)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(InvalidInputError, match="state must be the dict"):
        attn.step(q, q, q, torch.zeros(3))
    state = attn.init_state(1)
    _, state = attn.step(q, q, q, state)
    with pytest.raises(InvalidInputError, match=r"expected \(1, 2, 4, 5\)"):
        attn.step(q, q, torch.randn(1, 2, 3, 5), state)


def test_forced_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    attn = _build("linear", backend="triton")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(BackendUnavailableError, match="triton"):
        attn(q, q, q, causal=True)


def test_backend_not_offered():
    with pytest.raises(InvalidInputError, match=r"backend: .*offers \['numba', 'torch'\].*got 'triton'"):
        _build("rfa", backend="triton")
