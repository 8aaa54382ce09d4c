"""attnkit mechanisms in tiny Llama-style (grouped-query attention, RoPE) and GPT-2-style models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_model, twin

import attnkit
import attnkit_transformers
from attnkit import UnsupportedFeatureError

KINDS = ["llama", "gpt2"]
ATOL = 2e-5


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def _has(name: str) -> bool:
    try:
        attnkit.get_spec(name)
    except KeyError:
        return False
    return True


needs_local = pytest.mark.skipif(
    not _has("local"), reason="'local' is not registered: it comes with the attnkit-sparse plugin, not installed here")


@pytest.mark.parametrize("kind", KINDS)
def test_softmax_logits_equal_sdpa(kind):
    ours, ref = twin(kind, "attnkit:softmax", "sdpa")
    ids = _ids(2, 13)
    with torch.no_grad():
        a = ours(ids).logits
        b = ref(ids).logits
    assert a.shape == (2, 13, VOCAB)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    # the attnkit module lives on the transformers module: one per layer
    assert sum(1 for n, _ in ours.named_modules() if n.endswith("attnkit_mechanisms.attnkit:softmax")) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_gives_the_unpadded_logits(kind):
    model = make_model(kind, "attnkit:softmax")
    a, b = _ids(1, 9, seed=2), _ids(1, 6, seed=3)
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0] = a[0]
    batch[1, 3:] = b[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, position_ids=pos).logits
        alone_a = model(a).logits
        alone_b = model(b).logits
    torch.testing.assert_close(padded[0], alone_a[0], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(padded[1, 3:], alone_b[0], atol=ATOL, rtol=1e-4)
    # the padding reached the mechanism: without the mask the padded row differs
    with torch.no_grad():
        unmasked = model(batch, position_ids=pos).logits
    assert (unmasked[1, 3:] - alone_b[0]).abs().max() > 1e-3


def test_padding_is_a_structured_mask_for_kernelized_mechanisms():
    """causal & key padding arrive as structured kinds, so a mechanism without attn_mask runs them."""
    if not _has("linear"):
        pytest.skip("'linear' comes with the attnkit-kernelized plugin, not installed here")
    model = make_model("llama", "attnkit:linear")
    ids = _ids(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)     # RoPE positions of the real tokens, as generate() gives
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=pos).logits
        alone = model(ids[1:, 2:]).logits
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[1, 2:], alone[0], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_sdpa(kind):
    ours, ref = twin(kind, "attnkit:softmax", "sdpa")
    ids = _ids(2, 5, seed=4)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        b = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert a.shape == (2, 25)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_generation(kind):
    """softmax matches sdpa on a left-padded batch; a streaming mechanism's cached tokens equal uncached ones."""
    ids = _ids(2, 7, seed=9)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0, attention_mask=mask)
    ours, ref = twin(kind, "attnkit:softmax", "sdpa")
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))
    if not _has("linear"):
        return
    model = make_model(kind, "attnkit:linear")
    with torch.no_grad():
        cached, uncached = model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (2, 17) and torch.equal(cached, uncached)


def test_cached_decoding_equals_the_full_forward_for_exact():
    model = make_model("llama", "attnkit:softmax")
    ids = _ids(1, 9, seed=5)
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        pre = model(ids[:, :8], use_cache=True)
        step = model(ids[:, 8:], past_key_values=pre.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, atol=ATOL, rtol=1e-4)


def test_streaming_mechanism_decodes_through_its_state():
    if not _has("linear"):
        pytest.skip("'linear' comes with the attnkit-kernelized plugin, not installed here")
    model = make_model("llama", "attnkit:linear")
    ids = _ids(2, 7, seed=6)
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        pre = model(ids[:, :5], use_cache=True)
        s1 = model(ids[:, 5:6], past_key_values=pre.past_key_values, use_cache=True)
        s2 = model(ids[:, 6:], past_key_values=s1.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(s2, full, atol=1e-4, rtol=1e-3)
    with torch.no_grad():  # a cache the state was not built from is refused, not used
        other = model(_ids(2, 5, seed=7), use_cache=True)
        with pytest.raises(UnsupportedFeatureError, match="use_cache=False"):
            model(ids[:, 5:6], past_key_values=pre.past_key_values, use_cache=True)
        del other


def _cached_yes() -> list[str]:
    return [r["name"] for r in attnkit_transformers.generation_support() if r["cached"].startswith("yes")]


@pytest.mark.parametrize("name", _cached_yes())
def test_cached_decoding_equals_the_full_forward(name):
    """What the generation table promises: prefill + two cached steps give the full forward's logits."""
    model = make_model("llama", name)
    ids = _ids(2, 9, seed=8)
    with torch.no_grad():
        full = model(ids).logits[:, -2:]
        pre = model(ids[:, :7], use_cache=True)
        s1 = model(ids[:, 7:8], past_key_values=pre.past_key_values, use_cache=True)
        s2 = model(ids[:, 8:], past_key_values=s1.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([s1.logits[:, -1:], s2.logits[:, -1:]], 1), full, atol=1e-4, rtol=1e-3)


def test_the_generation_table_in_the_docs_matches_the_registry():
    doc = Path(__file__).resolve().parents[3] / "docs" / "transformers.md"
    if not doc.exists():
        pytest.skip(f"{doc} is not there (tests run outside the repository)")
    text = doc.read_text(encoding="utf-8")
    rows = attnkit_transformers.generation_table().splitlines()
    missing = [r for r in rows if r not in text]
    assert not missing, ("docs/transformers.md is out of date; regenerate the table with "
                         f"`python -m attnkit_transformers`; rows missing: {missing}")


def test_approximation_without_streaming_refuses_cached_decoding():
    rows = {r["name"]: r for r in attnkit_transformers.generation_support()}
    refused = [n for n, r in rows.items() if r["cached"].startswith("refused: use generate")]
    if not refused:
        pytest.skip("every installed mechanism supports cached generation")
    name = refused[0]
    model = make_model("llama", name)
    ids = _ids(1, 6)
    with torch.no_grad():
        pre = model(ids[:, :5], use_cache=True)
        with pytest.raises(UnsupportedFeatureError, match="use_cache=False"):
            model(ids[:, 5:], past_key_values=pre.past_key_values, use_cache=True)
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, use_cache=False,
                             pad_token_id=0)
    assert out.shape == (1, 9)


def test_a_mask_the_mechanism_cannot_honour_is_refused():
    """A 4-D mask that is neither causal nor padding reaches a mechanism without attn_mask: it raises."""
    refusing = [s.name for s in attnkit.available() if "tensor" not in s.capabilities.mask_kinds
                and s.capabilities.causal]
    if not refusing:
        pytest.skip("every installed mechanism honours arbitrary masks")
    model = make_model("llama", f"attnkit:{refusing[0]}")
    ids = _ids(1, 6)
    custom = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    custom[0, 0, 5, 2] = False                     # causal with one hole: not a structured kind
    with torch.no_grad(), pytest.raises(UnsupportedFeatureError, match="tensor"):
        model(ids, attention_mask=custom)
    # softmax honours the same mask, and it changes the output (it is not dropped)
    soft = make_model("llama", "attnkit:softmax")
    with torch.no_grad():
        holed = soft(ids, attention_mask=custom).logits
        plain = soft(ids).logits
    assert (holed[0, 5] - plain[0, 5]).abs().max() > 1e-4
    torch.testing.assert_close(holed[0, :5], plain[0, :5], atol=ATOL, rtol=1e-4)


def test_dropout_is_refused_not_ignored():
    model = make_model("gpt2", "attnkit:softmax", attn_pdrop=0.1).train()
    with pytest.raises(UnsupportedFeatureError, match="dropout"):
        model(_ids(1, 4))


def _mechanisms() -> list[str]:
    return [s.name for s in attnkit.registry.default_registry().specs()]


@pytest.mark.parametrize("name", _mechanisms())
def test_every_mechanism_trains_or_refuses_clearly(name):
    model = make_model("llama", f"attnkit:{name}").train()
    ids = _ids(2, 8)
    try:
        out = model(ids, labels=ids)
    except (UnsupportedFeatureError, attnkit.InvalidInputError) as exc:
        msg = str(exc)
        assert name in msg and len(msg) > 60, msg       # names the mechanism and says why
        return
    out.loss.backward()
    assert torch.isfinite(out.loss)
    grads = [p.grad for p in model.model.embed_tokens.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["softmax", "performer", "routing", "dynamic-span"])
def test_gradient_checkpointing_equals_the_plain_step(name):
    """transformers' gradient_checkpointing_enable() (non-reentrant by default): the loss with the auxiliary losses
    and every gradient equal the plain step's; routing's recomputation routes with the centroids its first run
    used, the spans and routing record once."""
    if not _has(name):
        pytest.skip(f"{name!r} is not registered here (its plugin is not installed)")
    import copy
    base = make_model("llama", f"attnkit:{name}").train()
    attnkit_transformers.prepare(base)
    ids = _ids(2, 12)
    runs = []
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(5)
        out = model(ids, labels=ids)
        loss = out.loss + sum(attnkit.aux_losses(model).values())
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(runs[0]) == len(runs[1]) > 1
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_options_from_register_and_config_and_reproducible_seeds():
    if not _has("performer"):
        pytest.skip("'performer' comes with the attnkit-kernelized plugin, not installed here")
    keys = attnkit_transformers.register("performer", num_features=16, name="attnkit:performer-16")
    try:
        assert keys == ["attnkit:performer-16"]
        ids = _ids(1, 6)
        a = make_model("llama", "attnkit:performer-16")
        b = make_model("llama", "attnkit:performer-16")
        with torch.no_grad():
            la, lb = a(ids).logits, b(ids).logits
        torch.testing.assert_close(la, lb, atol=0, rtol=0)       # same seed, same random features
        attn = a.model.layers[0].self_attn.attnkit_mechanisms["attnkit:performer-16"]
        assert "num_features=16" in repr(attn)
        c = make_model("llama", "attnkit:performer-16", attnkit_options={"num_features": 8})
        with torch.no_grad():
            c(ids)
        assert "num_features=8" in repr(c.model.layers[0].self_attn.attnkit_mechanisms["attnkit:performer-16"])
        with pytest.raises(attnkit.InvalidInputError, match="num_featurs"):
            attnkit_transformers.register("performer", num_featurs=16)
    finally:
        attnkit_transformers.unregister("attnkit:performer-16")


def test_learned_parameters_are_submodules():
    """A learned mechanism's parameters are the model's: prepared before the optimizer, trained, moved."""
    if not _has("fast-weight"):
        pytest.skip("'fast-weight' comes with the attnkit-kernelized plugin, not installed here")
    model = make_model("llama", "attnkit:fast-weight").train()
    before = sum(p.numel() for p in model.parameters())
    assert attnkit_transformers.prepare(model) == 2
    ours = {n: p for n, p in model.named_parameters() if ".attnkit_mechanisms.attnkit:fast-weight." in n}
    assert ours and sum(p.numel() for p in model.parameters()) == before + sum(p.numel() for p in ours.values())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    start = {n: p.detach().clone() for n, p in ours.items()}
    ids = _ids(2, 6)
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert all(not torch.equal(start[n], p) for n, p in ours.items() if p.grad is not None)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.values())
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in ours.values())
    assert "model.layers.1.self_attn.attnkit_mechanisms.attnkit:fast-weight" in dict(model.named_modules())
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()       # runs in float64 with the moved parameters


@needs_local
def test_local_with_a_window_wider_than_the_sequence_equals_softmax():
    keys = attnkit_transformers.register("local", window=64, name="attnkit:local-64")
    try:
        ours, ref = twin("llama", "attnkit:local-64", "attnkit:softmax")
        ids = _ids(2, 12)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-3)
        assert keys == ["attnkit:local-64"]
    finally:
        attnkit_transformers.unregister("attnkit:local-64")


@needs_local
def test_local_generates_20_tokens():
    model = make_model("llama", "attnkit:local")
    ids = _ids(1, 5)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 25)
