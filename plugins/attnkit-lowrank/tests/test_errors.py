"""Bad input gets a clear error naming the argument, what was expected and what was given."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import InvalidInputError, UnsupportedFeatureError


def _qkv(L=8, S=None, D=8, E=6):
    S = L if S is None else S
    return torch.randn(1, 2, L, D), torch.randn(1, 2, S, D), torch.randn(1, 2, S, E)


def test_linformer_refuses_a_sequence_longer_than_max_length():
    attn = attnkit.build("linformer", proj_len=4, max_length=16)
    attn(*_qkv(16))
    with pytest.raises(UnsupportedFeatureError, match=r"L=17, S=17.*max_length 16"):
        attn(*_qkv(17))
    assert attn.limits.max_length == 16


def test_linformer_refuses_causal_and_lists_causal_alternatives():
    attn = attnkit.build("linformer", proj_len=4, max_length=16)
    with pytest.raises(UnsupportedFeatureError) as err:
        attn(*_qkv(8), causal=True)
    msg = str(err.value)
    assert "causal" in msg and "no causal form" in msg
    assert "softmax" in msg                     # an installed implementation with a causal form


def test_linformer_refuses_key_padding_with_its_reason():
    attn = attnkit.build("linformer", proj_len=4, max_length=16)
    with pytest.raises(UnsupportedFeatureError, match="cannot be made absent"):
        attn(*_qkv(8), key_padding_mask=torch.ones(1, 8, dtype=torch.bool))


@pytest.mark.parametrize("L,S", [(9, 9), (5, 12), (12, 5)])
def test_nystrom_refuses_more_landmarks_than_tokens(L, S):
    attn = attnkit.build("nystrom", num_landmarks=8)
    if min(L, S) >= 8:
        assert attn(*_qkv(L, S)).shape == (1, 2, L, 6)
        return
    assert attn.limits.why_not(L, S) is not None        # a limit of the instance (the kit and programs keep to it)
    with pytest.raises(UnsupportedFeatureError, match=rf"L={L}, S={S}: .*num_landmarks 8: 8 landmarks need at least "
                                                      r"8 queries and 8 keys"):
        attn(*_qkv(L, S))
    with pytest.raises(InvalidInputError, match=rf"num_landmarks: 8 landmarks outnumber.*L={L}.*S={S}"):
        attn.landmark_count(L, S)                       # asked directly (the plain reference does)


def test_nystrom_conv_residual_needs_num_heads_odd_kernel_and_equal_lengths():
    with pytest.raises(InvalidInputError, match="num_heads"):
        attnkit.build("nystrom", conv_kernel_size=3)
    with pytest.raises(InvalidInputError, match="conv_kernel_size: expected an odd int"):
        attnkit.build("nystrom", conv_kernel_size=4, num_heads=2)
    attn = attnkit.build("nystrom", num_landmarks=2, conv_kernel_size=3, num_heads=2)
    with pytest.raises(UnsupportedFeatureError, match="L must equal S"):
        attn(*_qkv(6, 8))


def test_nystrom_refuses_causal_with_its_reason():
    with pytest.raises(UnsupportedFeatureError, match="landmarks are means over the whole sequence"):
        attnkit.build("nystrom", num_landmarks=2)(*_qkv(8), causal=True)


def test_soft_refuses_cross_attention():
    attn = attnkit.build("soft", stride=2, bottleneck="pool")
    with pytest.raises(UnsupportedFeatureError, match=r"L=8 != S=10.*Q = K.*L == S"):
        attn(*_qkv(8, 10))


def test_soft_refuses_a_stride_that_does_not_fit():
    """A limit of the instance (``limits``: the conformance kit and torch.export programs keep to it)."""
    attn = attnkit.build("soft", stride=16, bottleneck="pool")
    assert attn.limits.why_not(9, 9) is not None and attn.limits.why_not(16, 16) is None
    with pytest.raises(UnsupportedFeatureError, match=r"L=9, S=9: .*stride 16: a bottleneck window of 16 positions "
                                                      r"needs at least 16 keys"):
        attn(*_qkv(9))
    assert attn(*_qkv(16)).shape == (1, 2, 16, 6)
    assert attn(*_qkv(0)).shape == (1, 2, 0, 6)                     # empty in, empty out
    assert attnkit.build("soft", bottleneck="pool")(*_qkv(9)).shape == (1, 2, 9, 6)   # stride=None: any length


def test_soft_conv_needs_head_dim():
    with pytest.raises(InvalidInputError, match="head_dim"):
        attnkit.build("soft")


@pytest.mark.parametrize("name,options,match", [
    ("nystrom", {"num_landmarks": 0}, "num_landmarks"),
    ("nystrom", {"pinv_iterations": -1}, "pinv_iterations"),
    ("linformer", {"proj_len": 0}, "proj_len"),
    ("linformer", {"per_head": True}, "num_heads"),
    ("soft", {"bottleneck": "max", "head_dim": 8}, "bottleneck"),
    ("soft", {"stride": 0, "head_dim": 8}, "stride"),
])
def test_bad_options_name_the_option(name, options, match):
    with pytest.raises(InvalidInputError, match=match):
        attnkit.build(name, **options)


def test_memory_compressed_refuses_a_stride_that_does_not_fit_and_a_wrong_value_dim():
    attn = attnkit.build("mca", stride=4, compression="pool")
    assert attn.limits.why_not(8, 3) is not None and attn.limits.why_not(2, 4) is None
    with pytest.raises(UnsupportedFeatureError, match=r"L=8, S=3: .*stride 4: a compression window of 4 positions "
                                                      r"needs at least 4 keys"):
        attn(*_qkv(8, 3))
    assert attn(*_qkv(2, 4)).shape == (1, 2, 2, 6)                 # fewer queries than the stride: any number
    assert attn(*_qkv(5, 0)).shape == (1, 2, 5, 6)                 # no keys: zeros
    attn = attnkit.build("mca", head_dim=8)                       # value_dim defaults to head_dim
    with pytest.raises(InvalidInputError, match=r"v: the value convolution was built for E=8"):
        attn(*_qkv(9, E=6))


def test_informer_refuses_key_padding_with_its_reason():
    q, k, v = _qkv(8)
    kpm = torch.ones(q.shape[0], 8, dtype=torch.bool)
    with pytest.raises(UnsupportedFeatureError, match="lazy mean"):
        attnkit.build("informer")(q, k, v, causal=True, key_padding_mask=kpm)


def test_clustered_refuses_more_clusters_than_queries_and_top_k_above_keys():
    with pytest.raises(InvalidInputError, match=r"clusters: 9 clusters outnumber the L=8 queries; expected "
                                                r"clusters <= 8"):
        attnkit.build("clustered", clusters=9)(*_qkv(8))
    with pytest.raises(InvalidInputError, match=r"top_k: 10 keys per cluster outnumber the S=8 keys"):
        attnkit.build("improved-clustered", clusters=2, top_k=10)(*_qkv(8))


def test_isab_needs_head_dim_and_num_heads_per_head():
    with pytest.raises(InvalidInputError, match="head_dim"):
        attnkit.build("isab")
    with pytest.raises(InvalidInputError, match="num_heads"):
        attnkit.build("isab", head_dim=8, per_head=True)


@pytest.mark.parametrize("name", ["nystrom", "linformer", "soft", "memory-compressed", "informer", "clustered",
                                  "improved-clustered", "isab"])
def test_defaults_run_short_sequences_in_a_transformer(name):
    """Paper defaults (64 landmarks, 100 clusters, stride 64, ...) adapt to 8 tokens; explicit values do not."""
    torch.manual_seed(0)
    model = attnkit.Transformer(16, depth=1, num_heads=2, attention=name)
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = model(x)
    y.square().mean().backward()
    assert y.shape == (2, 8, 16) and torch.isfinite(x.grad).all()


def test_default_landmarks_and_clusters_follow_the_length():
    assert attnkit.build("nystrom").landmark_count(9, 5) == 9
    assert attnkit.build("nystrom").landmark_count(500, 300) == 64
    assert attnkit.build("clustered").cluster_count(50) == 50
    assert attnkit.build("improved-clustered").top_k_count(10) == 10
