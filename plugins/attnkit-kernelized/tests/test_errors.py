"""Bad input gets a clear error naming the argument, what was expected and what was given."""

from __future__ import annotations

import math

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
def test_attn_mask_is_refused_with_the_reason(name, mask):
    attn = _build(name)
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(UnsupportedFeatureError) as exc:
        attn(q, q, q, causal=True, attn_mask=mask)
    msg = str(exc.value)
    assert name in msg and "attn_mask" in msg and "key_padding_mask" in msg   # the plugin's refusal reason
    assert "expected attn_mask=None" in msg and str(tuple(mask.shape)) in msg
    assert "softmax" in msg           # names an implementation that does support it


# ------------------------------------------------------------------ options
BAD_OPTIONS = [
    # (name, options, option named in the message)
    ("linear", {"feature_map": "tanh"}, "feature_map"),
    ("linear", {"feature_map": 3}, "feature_map"),
    ("linear", {"chunk_size": 0}, "chunk_size"),
    ("linear", {"chunk_size": 2.0}, "chunk_size"),
    ("linear", {"dpfp_nu": 2}, "dpfp_nu"),
    ("linear", {"feature_map": "dpfp", "dpfp_nu": 0}, "dpfp_nu"),
    ("linear", {"feature_map": "dpfp", "dpfp_nu": True}, "dpfp_nu"),
    ("performer", {"feature_map": "softmax"}, "feature_map"),
    ("performer", {"num_features": 0}, "num_features"),
    ("performer", {"num_features": 2.5}, "num_features"),
    ("performer", {"num_features": "64"}, "num_features"),
    ("performer", {"num_features": True}, "num_features"),
    ("performer", {"orthogonal": "no"}, "orthogonal"),
    ("performer", {"orthogonal": 1}, "orthogonal"),
    ("performer", {"redraw_interval": 0}, "redraw_interval"),
    ("performer", {"redraw_interval": 1.5}, "redraw_interval"),
    ("performer", {"seed": 1.5}, "seed"),
    ("performer", {"seed": -1}, "seed"),
    ("performer", {"seed": "0"}, "seed"),
    ("performer", {"scale": math.inf}, "scale"),
    ("rfa", {"feature_map": "relu"}, "feature_map"),
    ("rfa", {"num_features": -3}, "num_features"),
    ("rfa", {"seed": 1.5}, "seed"),
    ("rfa", {"scale": math.inf}, "scale"),
    ("rfa", {"scale": -1.0}, "scale"),
    ("rfa", {"sigma": -1.0}, "sigma"),
    ("rfa", {"sigma": math.inf}, "sigma"),
    ("rfa", {"sigma": math.nan}, "sigma"),
    ("rfa", {"sigma": "1"}, "sigma"),
    ("rfa", {"gate_init": 1.0}, "gate_init"),
    ("rfa", {"gate_init": True}, "gate_init"),
    ("rfa", {"gate": "no"}, "gate"),
    ("rfa", {"learn_sigma": "yes"}, "learn_sigma"),
    ("rfa", {"orthogonal": None}, "orthogonal"),
    ("fast-weight", {"feature_map": "cosine"}, "feature_map"),
    ("fast-weight", {"beta": 1.5}, "beta"),
    ("fast-weight", {"beta": 0}, "beta"),
    ("fast-weight", {"beta": math.nan}, "beta"),
    ("fast-weight", {"beta": "0.5"}, "beta"),
    ("fast-weight", {"normalize": "no"}, "normalize"),
    ("fast-weight", {"normalize": 0}, "normalize"),
    ("fast-weight", {"dpfp_nu": 2, "feature_map": "elu"}, "dpfp_nu"),
    ("fast-weight", {"chunk_size": -1}, "chunk_size"),
]


@pytest.mark.parametrize("name,opts,arg", BAD_OPTIONS, ids=lambda x: str(x))
@pytest.mark.parametrize("via", ["build", "class"])
def test_bad_options_name_the_option_the_expectation_and_the_value(name, opts, arg, via):
    """Type, range and choice of every constructor option (``"no"`` is not taken for True, 1.5 is not a
    seed, inf is not a scale): InvalidInputError naming the option, what it expects and what it got, through
    attnkit.build and when the class is built directly (the module's own checks)."""
    with pytest.raises(InvalidInputError) as exc:
        if via == "build":
            _build(name, **opts)
        else:
            attnkit.get_spec(name).load_factory()(**{"num_heads": 2, "head_dim": 8, **opts})
    msg = str(exc.value)
    assert f"{arg}:" in msg and "expected" in msg and "got" in msg
    assert repr(opts[arg]) in msg


@pytest.mark.parametrize("name", ["performer", "rfa", "fast-weight"])
def test_head_dim_is_required(name):
    with pytest.raises(InvalidInputError, match="head_dim: expected"):
        attnkit.build(name, num_heads=2)


@pytest.mark.parametrize("name", ["rfa", "fast-weight"])
def test_num_heads_is_required_for_per_head_parameters(name):
    with pytest.raises(InvalidInputError, match="num_heads: expected"):
        attnkit.build(name, head_dim=4)


def test_redraw_with_a_bad_seed():
    attn = _build("performer", num_features=4)
    with pytest.raises(InvalidInputError, match=r"seed: expected an int >= 0 or None, got 0\.5"):
        attn.redraw_features(seed=0.5)


# ------------------------------------------------------------------ inputs and states
@pytest.mark.parametrize("name", NAMES)
def test_head_dim_differs_from_the_built_one(name):
    attn = _build(name, head_dim=16)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(InvalidInputError, match="head_dim=16"):
        attn(q, q, q, causal=True)
    with pytest.raises(InvalidInputError, match="head_dim=16"):
        attn.step(q, q, q, attn.init_state(1))


def test_fast_weight_is_causal_only():
    attn = _build("delta")
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(UnsupportedFeatureError, match="causal=False"):
        attn(q, q, q)


def test_wrong_head_count_for_per_head_parameters():
    attn = _build("rfa")
    q = torch.randn(1, 3, 5, 8)
    with pytest.raises(InvalidInputError, match="num_heads=2.*H=3"):
        attn(q, q, q, causal=True)


def test_a_state_with_other_value_sizes():
    attn = _build("performer", num_features=4)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(InvalidInputError, match="state must come from"):
        attn.step(q, q, q, torch.zeros(3))
    state = attn.init_state(1)
    _, state = attn.step(q, q, q, state)
    with pytest.raises(InvalidInputError, match=r"S of shape \(1, 2, 4, 5\) expected.*got \(1, 2, 4, 8\)"):
        attn.step(q, q, torch.randn(1, 2, 3, 5), state)
    with pytest.raises(InvalidInputError, match=r"S of shape \(1, 2, 4, 5\) expected"):
        attn(q, q, torch.randn(1, 2, 3, 5), causal=True, state=state, return_state=True)


@pytest.mark.parametrize("name", ["linear", "rfa", "fast-weight"])
def test_forced_triton_on_cpu_without_the_interpreter(monkeypatch, name):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    attn = _build(name, backend="triton")
    q = torch.randn(1, 2, 4, 8)
    for causal in (True, False) if name != "fast-weight" else (True,):
        with pytest.raises(BackendUnavailableError, match="triton"):
            attn(q, q, q, causal=causal)


@pytest.mark.parametrize("name,backend", [("rfa", "cuda"), ("fast-weight", "flex"), ("linear", "cuda")])
def test_backend_not_offered(name, backend):
    """Refused when built (by the registry's option check or the module's), naming the offered backends."""
    with pytest.raises(InvalidInputError) as exc:
        _build(name, backend=backend)
    msg = str(exc.value)
    assert "backend" in msg and repr(backend) in msg and "'numba', 'torch', 'triton'" in msg
    cls = attnkit.get_spec(name).load_factory()
    expected = rf"backend: expected one of \['auto', 'numba', 'torch', 'triton'\], got {backend!r}"
    with pytest.raises(InvalidInputError, match=expected):
        cls(num_heads=2, head_dim=8, backend=backend)


@pytest.mark.parametrize("name, options, pattern", [
    ("performer", {"num_features": 0}, r"build\('performer'\): option num_features: expected a value >= 1"),
    ("performer", {"feature_map": "gelu"}, r"option feature_map: expected one of"),
    ("rfa", {"gate_init": 1.0}, r"build\('rfa'\): option gate_init: expected a value < 1"),
    ("rfa", {"sigma": 0.0}, r"option sigma: expected a value > 0"),
    ("linear", {"chunk_size": 0}, r"build\('linear'\): option chunk_size: expected a value >= 1"),
    ("fast-weight", {"beta": 0.0}, r"option beta: expected a value > 0"),
])
def test_option_ranges_are_declared_so_build_refuses_before_constructing(name, options, pattern):
    import attnkit
    from attnkit.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=pattern):
        attnkit.build(name, head_dim=8, **options)
