"""Every bad input to the public API gets an error naming the argument, the expectation and the value."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Capabilities, InvalidInputError, UnsupportedFeatureError
from attnkit.softmax import SoftmaxAttention

q4 = torch.randn(2, 3, 5, 4)
v4 = torch.randn(2, 3, 5, 6)


@pytest.fixture
def attn():
    return attnkit.build("softmax")


@pytest.mark.parametrize("args, pattern", [
    ((q4[0], q4, v4), r"q must be 4-D \(B, H, L, D\), got 3-D"),
    ((q4, "k", v4), "k must be a torch.Tensor, got str"),
    ((q4, q4, v4.long()), "v must be a floating tensor, got dtype torch.int64"),
    ((q4, q4.double(), v4), "must share a dtype"),
    ((q4, torch.randn(3, 3, 5, 4), torch.randn(3, 3, 5, 6)), r"batch size B \(dim 0\)"),
    ((q4, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 6)), r"number of heads H \(dim 1\)"),
    ((q4, torch.randn(2, 3, 5, 7), v4), "share the head dimension D"),
    ((q4, q4, torch.randn(2, 3, 4, 6)), r"same length S \(dim 2\)"),
    ((q4, q4, torch.randn(2, 3, 5, 6, device="meta")), "must be on one device"),
])
def test_bad_qkv(attn, args, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        attn(*args)


@pytest.mark.parametrize("kw, pattern", [
    ({"key_padding_mask": torch.ones(2, 5)}, "key_padding_mask must be bool"),
    ({"key_padding_mask": torch.ones(2, 4, dtype=torch.bool)}, r"shape \(B, S\) = \(2, 5\), got \(2, 4\)"),
    ({"key_padding_mask": [True] * 5}, "key_padding_mask must be a bool tensor"),
    ({"attn_mask": torch.ones(5, 4, dtype=torch.bool)}, r"broadcastable to \(B, H, L, S\) = \(2, 3, 5, 5\)"),
    ({"attn_mask": torch.ones(5, 5, dtype=torch.int32)}, "attn_mask must be bool .* or an additive float"),
    ({"attn_mask": torch.ones(1, 1, 1, 5, 5, dtype=torch.bool)}, "broadcastable"),
    ({"causal": 1}, "causal: expected a bool"),
])
def test_bad_masks(attn, kw, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        attn(q4, q4, v4, **kw)


def test_wrong_device_mask(attn):
    with pytest.raises(InvalidInputError, match="key_padding_mask must be on cpu"):
        attn(q4, q4, v4, key_padding_mask=torch.ones(2, 5, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("kw, pattern", [
    ({"num_heads": 0}, r"build\('softmax'\): option num_heads: expected a value >= 1, got 0"),
    ({"head_dim": 2.5}, r"option head_dim: expected int or None, got 2.5 \(float\)"),
    ({"scale": -1.0}, "option scale: expected a value > 0, got -1.0"),
    ({"scale": float("nan")}, "option scale: expected a finite number, got nan"),
    ({"scale": float("inf")}, "option scale: expected a finite number, got inf"),
    ({"scale": "0.5"}, r"option scale: expected float or None, got '0.5' \(str\)"),
    ({"backend": 3}, r"option backend: expected str, got 3 \(int\)"),
    ({"backend": "numba"}, r"option backend: 'softmax' offers backends \['sdpa', 'torch'\]"),
    ({"dropout": 1.5}, "option dropout: expected a value < 1, got 1.5"),
    ({"dropout": True}, r"option dropout: expected float, got True \(bool\)"),
])
def test_bad_options_are_refused_before_building(kw, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        attnkit.build("softmax", **kw)


@pytest.mark.parametrize("kw, pattern", [
    ({"num_heads": 0}, "num_heads: expected a positive int"),
    ({"head_dim": 2.5}, "head_dim: expected a positive int"),
    ({"scale": float("nan")}, "scale: expected a finite float > 0"),
    ({"backend": 3}, "backend: expected a backend name"),
    ({"dropout": 1.5}, r"dropout: expected a float in \[0, 1\)"),
])
def test_constructors_check_again_when_built_directly(kw, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        SoftmaxAttention(**kw)


class Limited(SoftmaxAttention):
    """Softmax that declares almost nothing."""


LIMITED = Capabilities(causal=False, key_padding_mask=False, attn_mask=False, cross=False, dtypes=("float64",))


@pytest.fixture
def limited():
    with attnkit.registered(Limited, name="limited-test", capabilities=LIMITED):
        yield attnkit.build("limited-test")


@pytest.mark.parametrize("call, pattern", [
    (lambda a: a(q4.double(), q4.double(), v4.double(), causal=True), "does not support causal=True"),
    (lambda a: a(q4.double(), q4.double(), v4.double(), key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
     "does not support key_padding_mask"),
    (lambda a: a(q4.double(), q4.double(), v4.double(), attn_mask=torch.ones(5, 5, dtype=torch.bool)),
     "does not support attn_mask"),
    (lambda a: a(q4[:, :, :2].double(), q4.double(), v4.double()), r"cross-attention \(L=2 != S=5\)"),
    (lambda a: a(q4, q4, v4), "does not support dtype float32: it takes float64"),
    (lambda a: a.init_state(1), r"does not support streaming"),
])
def test_undeclared_capabilities_are_refused_naming_who_supports_them(limited, call, pattern):
    with pytest.raises(UnsupportedFeatureError, match=pattern) as info:
        call(limited)
    assert "'limited-test'" in str(info.value)
    assert "softmax" in info.value.supported_by  # the installed implementation that does


def test_causal_cross_refused_without_capability():
    with attnkit.registered(Limited, name="no-causal-cross", capabilities=Capabilities(causal_cross=False)):
        a = attnkit.build("no-causal-cross")
        with pytest.raises(UnsupportedFeatureError, match="causal=True with L != S") as info:
            a(q4[:, :, :2], q4, v4, causal=True)
        assert "softmax" in info.value.supported_by


def test_causal_only_refuses_noncausal():
    with attnkit.registered(Limited, name="causal-only-test", capabilities=Capabilities(noncausal=False)):
        with pytest.raises(UnsupportedFeatureError, match="causal-only recurrence; pass causal=True"):
            attnkit.build("causal-only-test")(q4, q4, v4)


def test_step_validates(attn):
    state = attn.init_state(2)
    with pytest.raises(InvalidInputError, match="same T >= 1"):
        attn.step(q4, q4[:, :, :2], v4[:, :, :2], state)
    with pytest.raises(InvalidInputError, match="init_state: batch must be a positive int"):
        attn.init_state(0)


def test_bare_base_class_has_no_forward():
    class Bare(attnkit.Attention):
        pass

    with pytest.raises(NotImplementedError, match="Bare must implement _attend"):
        Bare()(q4, q4, v4)
