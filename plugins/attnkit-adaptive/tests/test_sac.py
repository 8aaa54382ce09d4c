"""sparse-adaptive: the chunked gather path against the dense reference, edge counts, predictor gradients."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.errors import InvalidInputError
from attnkit.masks import causal, key_padding
from attnkit_adaptive.sac.naive import reference


def _build(**kw):
    torch.manual_seed(0)
    return attnkit.build("sparse-adaptive", num_heads=2, head_dim=8, **kw).double()


@pytest.mark.parametrize("is_causal", [False, True])
def test_chunked_path_equals_reference_incl_predictor_grads(qkv, is_causal):
    attn = _build(num_edges=4, predictor_dim=3, distance_buckets=5, chunk_size=4)
    with torch.no_grad():
        attn.distance_encoding.normal_()
    q, k, v = qkv(11, grad=True)
    kpm = torch.ones(2, 11, dtype=torch.bool)
    kpm[0, 7:] = False
    out = attn(q, k, v, causal=is_causal, key_padding_mask=kpm)
    m = key_padding(kpm) if not is_causal else causal() & key_padding(kpm)
    ref = reference(attn, q, k, v, mask=m)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    params = (q, k, v, attn.pred_q, attn.pred_k, attn.distance_encoding)
    g = torch.randn_like(out)
    ga = torch.autograd.grad(out, params, g, retain_graph=True)
    gb = torch.autograd.grad(ref, params, g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    assert all(a.abs().sum() > 0 for a in ga[3:])  # the predictor is trained by the task loss


def test_each_query_attends_num_edges_keys(qkv):
    attn = _build(num_edges=3)
    q, k, _ = qkv(12)
    eye = torch.eye(12, dtype=torch.float64).expand(2, 2, 12, 12)
    w = attn(q, k, eye)  # identity values: the output is the weight matrix
    assert ((w > 0).sum(-1) == 3).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 12, dtype=torch.float64))
    wc = attn(q, k, eye, causal=True)
    assert ((wc > 0).sum(-1) == torch.clamp(torch.arange(1, 13), max=3)).all()
    assert (wc.triu(1) == 0).all()


def test_all_edges_and_a_silent_predictor_is_softmax(qkv):
    attn = _build(num_edges=64)
    with torch.no_grad():
        attn.pred_q.zero_()
    q, k, v = qkv(10)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn(q, k, v, causal=True), want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("opt", ["num_edges", "predictor_dim", "distance_buckets", "chunk_size"])
def test_bad_options(opt):
    with pytest.raises(InvalidInputError, match=rf"{opt}: expected a positive int, got 0"):
        attnkit.build("sparse-adaptive", num_heads=2, head_dim=8, **{opt: 0})
