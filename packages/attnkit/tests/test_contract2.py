"""Contract 2 in the core: one call context, mask objects, positions, state in forward, aux losses, limits."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import attnkit
from attnkit import Attention, Capabilities
from attnkit import masks as M
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit.reference import naive_attention


def qkv(B=2, H=2, L=7, S=None, D=4, E=3, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    S = L if S is None else S
    out = [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)
           for s in ((B, H, L, D), (B, H, S, D), (B, H, S, E))]
    return out


class Recorder(Attention):
    """Records the context it was called with; output = softmax through the dense mask."""

    capabilities = Capabilities(mask_kinds=("causal", "key_padding", "sliding_window"), backends=("torch",))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = []

    def _attend(self, q, k, v, ctx):
        self.seen.append(ctx)
        keep = ctx.dense_keep()
        return naive_attention(q, k, v, attn_mask=keep, scale=ctx.scale) if keep is not None else \
            naive_attention(q, k, v, scale=ctx.scale)


@pytest.fixture
def recorder():
    with attnkit.registered(Recorder, name="recorder", capabilities=Recorder.capabilities):
        yield attnkit.build("recorder")


def test_one_resolved_mask_reaches_the_implementation(recorder):
    q, k, v = qkv()
    kpm = torch.ones(2, 7, dtype=torch.bool)
    kpm[0, -2:] = False
    recorder(q, k, v, causal=True, key_padding_mask=kpm, mask=M.sliding_window(2))
    ctx = recorder.seen[-1]
    assert ctx.mask.kinds == {"causal", "key_padding", "sliding_window"}
    assert ctx.causal and torch.equal(ctx.key_padding_mask, kpm)
    assert ctx.backend == "torch" and ctx.scale == pytest.approx(0.5)
    assert ctx.geometry.L == 7 and ctx.geometry.S == 7


def test_mask_kind_not_honoured_is_refused_naming_who_does(recorder):
    q, k, v = qkv()
    with pytest.raises(UnsupportedFeatureError, match=r"'recorder' does not support a document mask.*softmax"):
        recorder(q, k, v, mask=M.document(torch.zeros(2, 7, dtype=torch.long)))
    with pytest.raises(UnsupportedFeatureError, match="attn_mask"):
        recorder(q, k, v, attn_mask=torch.ones(7, 7, dtype=torch.bool))
    with pytest.raises(UnsupportedFeatureError, match=r"union of masks"):
        recorder(q, k, v, mask=M.causal() | M.sliding_window(1))
    with pytest.raises(UnsupportedFeatureError, match="positions"):
        recorder(q, k, v, positions=3)


def test_softmax_honours_every_mask_kind_like_the_dense_reference():
    attn = attnkit.build("softmax")
    q, k, v = qkv(L=9, S=9)
    ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    fn = M.from_function(lambda b, h, qp, kp: (qp - kp) % 2 == 0, name="parity")
    for mask in (M.sliding_window(2), M.document(ids) & M.causal(), fn, M.sliding_window(1) | fn,
                 M.causal() & M.key_padding(torch.tensor([[True] * 9, [True] * 5 + [False] * 4]))):
        for backend in ("sdpa", "torch"):
            out = attnkit.build("softmax", backend=backend)(q, k, v, mask=mask)
            torch.testing.assert_close(out, naive_attention(q, k, v, mask=mask), atol=1e-10, rtol=1e-8)
    del attn


def test_old_signature_still_works_and_equals_mask_objects():
    attn = attnkit.build("softmax")
    q, k, v = qkv()
    kpm = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    old = attn(q, k, v, causal=True, key_padding_mask=kpm)
    new = attn(q, k, v, mask=M.causal() & M.key_padding(kpm))
    assert torch.equal(old, new)


class V1Style(Attention):
    """A plugin written against contract 1: _forward with three loose arguments."""

    capabilities = Capabilities(attn_mask=True, backends=("torch",))

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return naive_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


def test_a_version_1_implementation_runs_and_receives_any_mask_as_attn_mask():
    with attnkit.registered(V1Style, name="v1-style", capabilities=V1Style.capabilities):
        attn = attnkit.build("v1-style")
        q, k, v = qkv()
        mask = M.sliding_window(2) & M.causal()
        torch.testing.assert_close(attn(q, k, v, mask=mask), naive_attention(q, k, v, mask=mask))


def test_padded_keys_have_no_influence_whatever_they_hold():
    attn = attnkit.build("softmax")
    q, k, v = qkv()
    kpm = torch.tensor([[True] * 5 + [False] * 2, [True, False] * 3 + [True]])
    base = attn(q, k, v, key_padding_mask=kpm)
    for fill in (1e30, float("nan"), float("inf"), -float("inf")):
        k2, v2 = k.clone(), v.clone()
        k2[~kpm[:, None, :, None].expand_as(k2)] = fill
        v2[~kpm[:, None, :, None].expand_as(v2)] = fill
        for backend in ("sdpa", "torch"):
            out = attnkit.build("softmax", backend=backend)(q, k2, v2, key_padding_mask=kpm)
            assert torch.isfinite(out).all(), (fill, backend)
            torch.testing.assert_close(out, base, atol=1e-12, rtol=0)


def test_nan_query_row_gives_nan_in_that_row_only():
    q, k, v = qkv()
    q[0, 0, 3] = float("nan")
    for backend in ("sdpa", "torch"):
        out = attnkit.build("softmax", backend=backend)(q, k, v)
        assert torch.isnan(out[0, 0, 3]).all()
        rest = torch.ones_like(out, dtype=torch.bool)
        rest[0, 0, 3] = False
        assert torch.isfinite(out[rest]).all(), backend


@pytest.mark.parametrize("L, S", [(0, 0), (0, 5), (5, 0)])
def test_empty_sequences(L, S):
    q, k, v = qkv(L=L, S=S, grad=True)
    for backend in ("sdpa", "torch"):
        out = attnkit.build("softmax", backend=backend)(q, k, v, causal=(L == S))
        assert out.shape == (2, 2, L, 3) and not out.any()
        out.sum().backward()


def test_state_in_forward_trains_segment_by_segment():
    attn = attnkit.build("softmax")
    q, k, v = qkv(L=10, grad=True)
    full = attn(q, k, v, causal=True)
    state, outs = None, []
    for s0 in range(0, 10, 4):
        sl = slice(s0, s0 + 4)
        o, state = attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, state=state, return_state=True)
        outs.append(o)
    got = torch.cat(outs, dim=2)
    torch.testing.assert_close(got, full)
    g1 = torch.autograd.grad(got.sum(), (q, k, v))
    g2 = torch.autograd.grad(full.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert state.position == 10 and state.batch == 2
    # step is the inference spelling of the same thing
    st = attn.init_state(2, dtype=torch.float64)
    outs = []
    with torch.no_grad():
        for t in range(10):
            o, st = attn.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], st)
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), full.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_made_for_cuda_takes_inputs_on_cuda_0():
    """init_state(device="cuda") names no index while tensors on the GPU carry one (cuda:0): the state resolves it,
    so stepping with inputs on that GPU is not refused as another device (found on an H100, session 26)."""
    attn = attnkit.build("softmax")
    st = attn.init_state(1, device="cuda", dtype=torch.float32)
    assert st.device.index is not None
    q = torch.randn(1, 2, 1, 4, device="cuda")
    out, st = attn.step(q, q, q, st)
    assert out.device == q.device and st.position == 1


def test_state_device_without_an_index_is_the_tensor_device():
    from attnkit.state import _resolved

    assert _resolved(None) is None
    assert _resolved("cpu") == torch.empty(0).device
    assert _resolved(torch.device("meta")) == torch.empty(0, device="meta").device


def test_states_are_validated_never_cast():
    attn = attnkit.build("softmax")
    q, k, v = qkv()
    _, st = attn(q, k, v, causal=True, return_state=True)
    with pytest.raises(InvalidInputError, match="batch size 2, got q with batch size 1"):
        attn(q[:1], k[:1], v[:1], causal=True, state=st)
    with pytest.raises(InvalidInputError, match="holds torch.float64 tensors, got q of dtype torch.float32"):
        attn(q.float(), k.float(), v.float(), causal=True, state=st)
    other = attnkit.build("softmax", scale=0.3)
    with pytest.raises(InvalidInputError, match="another configuration"):
        other(q, k, v, causal=True, state=st)
    with pytest.raises(InvalidInputError, match="pass causal=True"):
        attn(q, k, v, state=st)
    with pytest.raises(InvalidInputError, match="state must come from init_state"):
        attn(q, k, v, causal=True, state={"k": None})


def test_state_of_another_mechanism_is_refused():
    class Other(attnkit.softmax.SoftmaxAttention):
        pass

    attn = attnkit.build("softmax")
    q, k, v = qkv()
    _, st = attn(q, k, v, causal=True, return_state=True)
    with attnkit.registered(Other, name="other-softmax", capabilities=attn.caps):
        other = attnkit.build("other-softmax")
        with pytest.raises(InvalidInputError, match="state belongs to 'softmax', not 'other-softmax'"):
            other.step(q, k, v, st)


def test_state_refused_without_streaming(recorder):
    q, k, v = qkv()
    with pytest.raises(UnsupportedFeatureError, match="state / return_state"):
        recorder(q, k, v, causal=True, return_state=True)


def test_positions_reach_the_context_and_shift_causal_masks():
    attn = attnkit.build("softmax")
    q, k, v = qkv(L=3, S=5)
    # keys at 0..4, queries at 0..2 (top-left) instead of the default 2..4
    pos = attnkit.Positions(q=torch.arange(3), k=torch.arange(5))
    out = attn(q, k, v, causal=True, positions=pos)
    keep = torch.arange(5)[None, :] <= torch.arange(3)[:, None]
    torch.testing.assert_close(out, naive_attention(q, k, v, attn_mask=keep))
    with pytest.raises(InvalidInputError, match="single tensor gives the positions of a self-attention"):
        attn(q, k, v, positions=torch.arange(3))
    with pytest.raises(InvalidInputError, match="positions: expected None, an int offset"):
        attn(q, k, v, positions="0")


def test_declared_heads_and_head_dim_are_enforced():
    attn = attnkit.build("softmax", num_heads=8)
    q, k, v = qkv(H=4)
    with pytest.raises(InvalidInputError, match="built with num_heads=8, got q with H=4"):
        attn(q, k, v)
    with pytest.raises(InvalidInputError, match="built with head_dim=16"):
        attnkit.build("softmax", head_dim=16)(*qkv())


class Limited(Recorder):
    capabilities = Capabilities(cross=False, backends=("torch",))

    @property
    def limits(self):
        return attnkit.Limits(max_length=8, equal_length=True, length_multiple=2)


def test_limits_are_enforced_with_the_limit_named():
    with attnkit.registered(Limited, name="limited", capabilities=Limited.capabilities):
        attn = attnkit.build("limited")
        attn(*qkv(L=8))
        with pytest.raises(UnsupportedFeatureError, match="max_length 8"):
            attn(*qkv(L=10))
        with pytest.raises(UnsupportedFeatureError, match="multiples of 2"):
            attn(*qkv(L=7))
    assert attnkit.Limits(equal_length=True).why_not(4, 6) == "L must equal S"


class Penalised(Recorder):
    """Records a penalty proportional to its scale parameter."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def _attend(self, q, k, v, ctx):
        self.record_aux_loss("penalty", self.w * 3)
        return super()._attend(q, k, v, ctx)


def test_aux_losses_are_collected_weighted_and_cleared():
    with attnkit.registered(Penalised, name="penalised", capabilities=Penalised.capabilities,
                            aux_losses={"penalty": 0.5}):
        layer = attnkit.MultiHeadAttention(8, 2, "penalised")
        model = torch.nn.Sequential(layer)
        x = torch.randn(1, 5, 8)
        layer(x)
        layer(x)  # two forwards before a collection add up
        got = attnkit.aux_losses(model)
        assert set(got) == {"penalty"}
        assert got["penalty"].item() == pytest.approx(2 * 2.0 * 3 * 0.5)
        got["penalty"].backward()
        assert layer.attention.w.grad.item() == pytest.approx(2 * 3 * 0.5)
        assert attnkit.aux_losses(model) == {}  # cleared
        layer(x)
        assert attnkit.aux_losses(model, weighted=False)["penalty"].item() == pytest.approx(6.0)
        layer.attention.aux_weights = {"penalty": 2.0}
        layer(x)
        assert attnkit.aux_losses(model)["penalty"].item() == pytest.approx(12.0)


def test_uncollected_aux_losses_in_the_graph_warn_once(recwarn):
    """Forwards in a graph that is never backpropagated, never collected, keep their graphs alive: one warning."""
    with attnkit.registered(Penalised, name="penalised", capabilities=Penalised.capabilities,
                            aux_losses={"penalty": 0.5}):
        attn = attnkit.build("penalised")
        q = qkv()
        with torch.no_grad():                        # no graph: nothing is kept alive, no warning
            for _ in range(attnkit.aux.UNCOLLECTED_WARN_AFTER + 1):
                attn(*q)
        attnkit.clear_aux_losses(attn)
        for _ in range(attnkit.aux.UNCOLLECTED_WARN_AFTER - 1):
            attn(*q)
        attnkit.aux_losses(attn)                     # a collection resets the count
        assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
        with torch.no_grad():                        # constants add up in one value, not one per call
            for _ in range(3):
                attn(*q)
        assert len(attn.__dict__["_attnkit_aux"]["penalty"]) == 1
        assert attn.pending_aux_losses()["penalty"].item() == pytest.approx(3 * 2.0 * 3)
        attnkit.clear_aux_losses(attn)
        for _ in range(2 * attnkit.aux.UNCOLLECTED_WARN_AFTER):
            attn(*q)
        warned = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
        assert len(warned) == 1
        assert "'penalty' 100 times without a collection" in str(warned[0].message)
        assert "attnkit.aux_losses(model)" in str(warned[0].message)


class SharedPenalised(Recorder):
    """Records a penalty that shares a saved-tensor node with the output (as dynamic span's does)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def _attend(self, q, k, v, ctx):
        q = q * self.w                               # saves q and w; the output's backward frees them
        self.record_aux_loss("penalty", q.square().mean())
        return super()._attend(q, k, v, ctx)


def _shared_penalised():
    """Register :class:`SharedPenalised` as ``shared-penalised`` (declaring ``penalty``) for a ``with`` block."""
    return attnkit.registered(SharedPenalised, name="shared-penalised", capabilities=SharedPenalised.capabilities,
                              aux_losses={"penalty": 1.0})


def test_uncollected_eager_record_does_not_break_a_compiled_step():
    """Records are summed at collection, not into a running sum: a compiled forward's one autograd node must not
    take an earlier record (whose graph the output's backward freed) as an input."""
    with _shared_penalised():
        attn = attnkit.build("shared-penalised")
        q, k, v = qkv(grad=True)
        attn(q, k, v).sum().backward()               # an eager step that never collects
        attn(q, k, v)                                # a forward without backward: its record stays
        compiled = torch.compile(attn, backend="aot_eager")
        for _ in range(2):
            compiled(q, k, v).sum().backward()       # raised "backward through the graph a second time" before
        got = attnkit.aux_losses(attn)["penalty"]    # compiled records are kept until collected
        torch.testing.assert_close(got.detach(), 3 * (q.detach() * 2.0).square().mean())


class DetachedPenalised(SharedPenalised):
    """Records a diagnostic outside the graph (no gradient), made from q: under a transform, its wrapper."""

    def _attend(self, q, k, v, ctx):
        self.record_aux_loss("penalty", (q.detach() * 2.0).square().mean())
        return Recorder._attend(self, q, k, v, ctx)


def test_aux_losses_under_torch_func_grad_collected_inside_and_stale_records_dropped():
    """Collected inside ``torch.func.grad``, a record counts in the transformed loss as under autograd. A record
    left uncollected that the output's backward does not drop (one outside the graph) is the transform's wrapper
    without storage: the next record or collection outside the transform drops it (kept, adaptive-span's program
    failed to export after a grad call: found by the kit's export check)."""
    import dataclasses
    import io
    import warnings

    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for cls in (SharedPenalised, DetachedPenalised):
        caps = dataclasses.replace(cls.capabilities, func_transforms=("grad",), export=True)
        with attnkit.registered(cls, name="penalised-func", capabilities=caps, aux_losses={"penalty": 1.0}):
            attn = attnkit.build("penalised-func").double().eval()
            q, k, v = qkv(dtype=torch.float64)

            def loss(a, attn=attn, k=k, v=v):
                return attn(a, k, v).square().sum() + sum(attnkit.aux_losses(attn).values())

            got = torch.func.grad(loss)(q)
            x = q.clone().requires_grad_(True)
            want, = torch.autograd.grad(loss(x), x)
            torch.testing.assert_close(got, want)
            torch.func.grad(lambda a, attn=attn, k=k, v=v: attn(a, k, v).square().sum())(q)   # not collected
            left = attn.__dict__["_attnkit_aux"]["penalty"]
            assert [wrapped(t) for t in left] == ([True] if cls is DetachedPenalised else [])
            assert attn.pending_aux_losses() == {}                    # not read outside the transform
            attn(q, k, v)                                             # the next record drops it
            assert not any(wrapped(t) for t in attn.__dict__["_attnkit_aux"]["penalty"])
            scale = 2.0 if cls is DetachedPenalised else attn.w.detach()
            torch.testing.assert_close(attnkit.aux_losses(attn)["penalty"].detach(), (q * scale).square().mean())
            torch.func.grad(lambda a, attn=attn, k=k, v=v: attn(a, k, v).square().sum())(q)

            class Plain(torch.nn.Module):
                def __init__(self, attn):
                    super().__init__()
                    self.attn = attn

                def forward(self, a, b, c):
                    return self.attn(a, b, c)

            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.export.export(Plain(attn), (q, k, v))
            torch.export.save(program, io.BytesIO())                  # failed while the stale record was kept


def _shared_step(attn, q, k, v, collect=True):
    out = attn(q, k, v)
    loss = out.square().sum()
    if collect:
        loss = loss + sum(attnkit.aux_losses(attn).values())
    loss.backward()


def test_records_a_backward_ran_without_are_dropped():
    """A step that does not collect (a warm-up) leaves nothing behind: the next, collecting step backpropagates
    (it raised "backward through the graph a second time" when the stale record was summed in) and gets the
    gradient of a fresh module's step."""
    with _shared_penalised():
        q, k, v = qkv(grad=True)
        fresh = attnkit.build("shared-penalised")
        _shared_step(fresh, q, k, v)
        attn = attnkit.build("shared-penalised")
        _shared_step(attn, q, k, v, collect=False)
        assert attn.pending_aux_losses() == {}
        attn.w.grad = None
        _shared_step(attn, q, k, v)
        torch.testing.assert_close(attn.w.grad, fresh.w.grad)
        # a retained graph keeps the record: it may still be backpropagated with it
        attn(q, k, v).sum().backward(retain_graph=True)
        assert set(attn.pending_aux_losses()) == {"penalty"}
        sum(attnkit.aux_losses(attn).values()).backward()
        # a collected record that the backward reached is not touched; two forwards before one backward
        attn(q, k, v)
        attn(q, k, v).sum().backward()               # reaches only the second forward's output
        assert attn.pending_aux_losses()["penalty"].item() == pytest.approx(
            (q.detach() * 2.0).square().mean().item())


def test_a_copy_between_forward_and_backward_leaves_the_records_behind():
    """copy.deepcopy (an EMA or best-model copy) raised "Only Tensors created explicitly by the user (graph leaves)
    support the deepcopy protocol" while a record was pending; pickling carried the records along."""
    import io
    with _shared_penalised():
        attn = attnkit.build("shared-penalised")
        q, k, v = qkv(grad=True)
        out = attn(q, k, v)
        twin = copy.deepcopy(attn)
        assert twin.pending_aux_losses() == {} and set(attn.pending_aux_losses()) == {"penalty"}
        buf = io.BytesIO()
        torch.save(attn, buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=False).pending_aux_losses() == {}
        (out.sum() + sum(attnkit.aux_losses(attn).values())).backward()     # the original's step goes on
        torch.testing.assert_close(twin(q, k, v), attn(q, k, v))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_records_once_per_forward(reentrant):
    """A forward recomputed during backward does not record again (it added a second, stale value the next step
    collected). With reentrant checkpointing the forward runs without grad, so its record is a constant."""
    from torch.utils.checkpoint import checkpoint
    with _shared_penalised():
        q, k, v = qkv(grad=True)
        plain = attnkit.build("shared-penalised")
        _shared_step(plain, q, k, v)
        attn = attnkit.build("shared-penalised")
        for step in range(2):
            attn.w.grad = None
            out = checkpoint(attn, q, k, v, use_reentrant=reentrant)
            aux = attnkit.aux_losses(attn)["penalty"]
            torch.testing.assert_close(aux.detach(), (q.detach() * 2.0).square().mean())
            if reentrant and step == 0:                  # the recomputation says the record trained nothing
                with pytest.warns(RuntimeWarning, match="use_reentrant=True.*constant and trains nothing"):
                    (out.square().sum() + aux).backward()
            else:
                (out.square().sum() + aux).backward()    # (warned once per module)
            assert attn.pending_aux_losses() == {}
        if not reentrant:
            torch.testing.assert_close(attn.w.grad, plain.w.grad)


class PenalisedBlock(attnkit.Block):
    declared_aux_losses = {"ponder": 1.0}

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x, **kwargs):
        y = x * self.w
        self.record_aux_loss("ponder", y.square().mean())
        return y


def test_block_records_are_tied_to_its_output():
    block = PenalisedBlock()
    x = torch.randn(2, 3, 4, requires_grad=True)
    block(x).sum().backward()
    assert block.pending_aux_losses() == {}
    out = block(x)
    (out.sum() + sum(attnkit.aux_losses(block).values())).backward()
    torch.testing.assert_close(block.w.grad, 2 * x.detach().sum() + 2 * 2.0 * x.detach().square().mean())


def test_reset_parameters_is_the_meta_device_recipe():
    """Built under torch.device('meta'), to_empty, then reset_parameters() under a seed: the parameters and
    buffers of a build under that seed (dtype and device kept); a module not built by name says why it cannot."""
    with attnkit.registered(Penalised, name="penalised", capabilities=Penalised.capabilities,
                            aux_losses={"penalty": 1.0}):
        torch.manual_seed(3)
        want = attnkit.build("penalised")
        with torch.device("meta"):
            meta = attnkit.build("penalised")
        assert meta.w.is_meta
        meta = meta.to_empty(device="cpu").double()
        torch.manual_seed(3)
        meta.reset_parameters()
        assert meta.w.dtype == torch.float64 and meta.w.item() == want.w.item() == 2.0
        with pytest.raises(InvalidInputError, match="was not built by attnkit.build"):
            Penalised().reset_parameters()
    Recorder().reset_parameters()                    # nothing to initialise: no error
    block = attnkit.build_block("pre-norm", dim=8, num_heads=2)
    with torch.no_grad():
        block.norm1.weight.fill_(float("nan"))
    block.reset_parameters()
    assert torch.equal(block.norm1.weight, torch.ones(8))


def test_a_whole_transformer_on_the_meta_device_is_initialised():
    """FSDP's recipe over every module: nothing left uninitialised (its blocks, built from their class, reset
    their children, containers included); a block's own reset_parameters() alone initialises its whole subtree."""
    with torch.device("meta"):
        model = attnkit.Transformer(8, depth=2, num_heads=2)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.fill_(float("nan"))                # what to_empty may leave
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    for name, t in model.state_dict().items():
        assert not t.is_floating_point() or bool(torch.isfinite(t).all()), name
    block = model.blocks[0]
    with torch.no_grad():
        for t in block.state_dict().values():
            if t.is_floating_point():
                t.fill_(float("nan"))
    block.reset_parameters()
    for name, t in block.state_dict().items():
        assert not t.is_floating_point() or bool(torch.isfinite(t).all()), name


def test_torch_func_transforms_run_the_torch_backend_or_are_refused():
    """Under torch.func transforms ``auto`` runs the torch backend; a transform the spec does not declare is refused
    naming the implementations that declare it."""
    from torch.func import grad, vmap
    caps = Capabilities(backends=("torch", "kitfake"), func_transforms=("grad",))

    class Picky(Recorder):
        def backend_order(self, device, dtype):
            return ("kitfake", "torch")

    q, k, v = qkv()
    with attnkit.registered(Picky, name="picky", capabilities=caps):
        attn = attnkit.build("picky")
        attn(q, k, v)
        assert attn.seen[-1].backend == "kitfake"            # auto outside a transform
        got = grad(lambda x: attn(x, k, v).sum())(q)
        assert attn.seen[-1].backend == "torch"              # auto under torch.func.grad
        x = q.clone().requires_grad_(True)
        attn(x, k, v).sum().backward()
        torch.testing.assert_close(got, x.grad)
        with pytest.raises(UnsupportedFeatureError, match=r"torch.func.vmap.*it declares \('grad',\).*softmax"):
            vmap(lambda a: attn(a, k[:1], v[:1]))(q[:, None])
        forced = attnkit.build("picky", backend="kitfake")
        with pytest.raises(UnsupportedFeatureError, match=r"torch.func.grad with backend='kitfake'.*backend='torch'"):
            grad(lambda x: forced(x, k, v).sum())(q)


def test_dual_tensors_of_forward_mode_ad_run_the_torch_backend_or_are_refused():
    """Dual tensors (``torch.autograd.forward_ad``) are a forward-mode derivative as ``torch.func.jvp`` takes one:
    ``auto`` runs the torch backend (a fused path would drop the tangents: the output came out without one), a
    spec without ``jvp`` and a forced backend are refused, naming forward-mode AD; a call without dual inputs
    inside ``dual_level`` keeps its backend, and ``transforms.active()`` is empty again after the call."""
    import torch.autograd.forward_ad as fwAD

    from attnkit import transforms
    caps = Capabilities(backends=("torch", "kitfake"), func_transforms=("grad", "jvp"))

    class Picky(Recorder):
        def backend_order(self, device, dtype):
            return ("kitfake", "torch")

        def _attend(self, q, k, v, ctx):
            self.active = transforms.active()
            return super()._attend(q, k, v, ctx)

    q, k, v = qkv()
    t = torch.randn_like(q)
    with attnkit.registered(Picky, name="picky", capabilities=caps):
        attn = attnkit.build("picky")
        _, want = torch.func.jvp(lambda x: attn(x, k, v), (q,), (t,))
        for needs_grad in (False, True):
            with fwAD.dual_level():
                attn(q, k, v)
                assert attn.seen[-1].backend == "kitfake" and attn.active == ()    # no dual input: as before
                out = attn(fwAD.make_dual(q.clone().requires_grad_(needs_grad), t), k, v)
                assert attn.seen[-1].backend == "torch" and attn.active == ("jvp",)
                tangent = fwAD.unpack_dual(out).tangent
            assert transforms.active() == () and not transforms.in_dual_call()
            torch.testing.assert_close(tangent, want)
        forced = attnkit.build("picky", backend="kitfake")
        with fwAD.dual_level(), pytest.raises(UnsupportedFeatureError,
                                              match=r"forward-mode AD \(dual tensors.*backend='kitfake'"):
            forced(fwAD.make_dual(q, t), k, v)
        assert not transforms.in_dual_call()                  # left on an error too
    with attnkit.registered(Picky, name="picky2", capabilities=Capabilities(backends=("torch",),
                                                                           func_transforms=("grad",))):
        with fwAD.dual_level(), pytest.raises(UnsupportedFeatureError, match=r"forward-mode AD.*declares \('grad',\)"):
            attnkit.build("picky2")(fwAD.make_dual(q, t), k, v)


def test_aux_records_of_an_ended_transform_are_dropped_inside_the_next_one():
    """A record left by ``torch.func.hessian`` (nested transforms) is a wrapper at levels that ended; read inside
    the next transform it raised PyTorch's internal "escaped?" assertion (adaptive-span, found by the kit's
    hessian case). Records of an ended level are dropped there too; the live transform's own are kept."""
    import dataclasses

    from torch.func import grad, hessian

    caps = dataclasses.replace(DetachedPenalised.capabilities, func_transforms=("grad", "vmap", "jvp"))
    with attnkit.registered(DetachedPenalised, name="penalised-nested", capabilities=caps,
                            aux_losses={"penalty": 1.0}):
        attn = attnkit.build("penalised-nested").double()
        q, k, v = qkv(B=1, H=1, L=3, D=2, E=2, dtype=torch.float64)

        def f(a):
            return attn(a, k, v).square().sum()

        hessian(f)(q)
        seen = {}

        def g(a):
            out = f(a)                                     # records its own penalty beside the ended one
            seen["pending"] = attn.pending_aux_losses()    # read inside the transform: its own record only
            return out

        grad(g)(q)                                         # raised "escaped?" before
        torch.testing.assert_close(seen["pending"]["penalty"], (q * 2.0).square().mean())


def test_batched_finds_a_vmapped_tensor_in_masks_at_any_level_of_wrapping():
    """``attnkit.transforms.batched``: a per-sample mask under vmap (also inside grad inside vmap, where it is
    wrapped again), never a mask captured from outside, never outside a transform."""
    from torch.func import grad, vmap

    from attnkit.transforms import batched

    seen = {}
    shared = torch.ones(1, 4, dtype=torch.bool)

    def f(a, m):
        seen["own mask"] = batched(attnkit.masks.key_padding(m[None]))
        seen["captured mask"] = batched(attnkit.masks.key_padding(shared))
        seen["closure"] = batched(attnkit.masks.from_function(lambda b, h, q, kv: m[kv], name="per-sample"))
        return (a * m).sum()

    vmap(f)(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.bool))
    assert seen == {"own mask": True, "captured mask": False, "closure": True}
    vmap(grad(f))(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.bool))
    assert seen["own mask"] and not seen["captured mask"]
    grad(f)(torch.randn(4), torch.ones(4, dtype=torch.bool))                  # grad alone: nothing batched
    assert not seen["own mask"]
    assert not batched(attnkit.masks.key_padding(shared))


def test_a_per_sample_additive_attn_mask_under_vmap_equals_the_calls_and_nan_in_one_sample_raises():
    """vmap over samples each with its own float ``attn_mask`` (one with ``-inf``, one finite): the values check and
    the ``-inf`` split read beneath vmap's wrapper (a branch on the batched mask raised vmap's "data-dependent
    control flow" error); a NaN in any sample raises InvalidInputError as eagerly."""
    from torch.func import vmap

    attn = attnkit.build("softmax").double()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    masks = torch.randn(2, 1, 1, 5, 5, generator=g, dtype=torch.float64)
    masks[0, ..., 2] = float("-inf")
    out = vmap(lambda a, b, d, m: attn(a, b, d, attn_mask=m))(q, k, v, masks)
    want = torch.stack([attn(q[i], k[i], v[i], attn_mask=masks[i]) for i in range(2)])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert not out[0, ..., :].isnan().any()
    bad = masks.clone()
    bad[1, 0, 0, 3, 1] = float("nan")
    with pytest.raises(InvalidInputError, match="attn_mask.*NaN or \\+inf"):
        vmap(lambda a, b, d, m: attn(a, b, d, attn_mask=m))(q, k, v, bad)


def test_setting_the_backend_attribute_after_a_call_switches():
    caps = Capabilities(backends=("torch", "kitfake"))
    q, k, v = qkv()
    with attnkit.registered(Recorder, name="two-backends", capabilities=caps):
        attn = attnkit.build("two-backends")
        attn(q, k, v)
        assert attn.seen[-1].backend == "torch"
        attn.backend = "kitfake"
        attn(q, k, v)
        assert attn.seen[-1].backend == "kitfake"          # the cached choice of the first call is not reused
        attn.backend = "nope"
        with pytest.raises(InvalidInputError, match="nope"):
            attn(q, k, v)


def test_undeclared_aux_loss_is_a_clear_error():
    with attnkit.registered(Penalised, name="penalised", capabilities=Penalised.capabilities):
        attn = attnkit.build("penalised")
        with pytest.raises(InvalidInputError, match="'penalty' its spec does not declare"):
            attn(*qkv())


def test_modules_deepcopy_pickle_and_save_whole():
    mha = attnkit.Transformer(8, 2, 2, "softmax")
    x = torch.randn(1, 5, 8)
    want = mha(x)
    for clone in (copy.deepcopy(mha), pickle.loads(pickle.dumps(mha))):
        torch.testing.assert_close(clone(x), want)
    buf = io.BytesIO()
    torch.save(mha, buf)
    buf.seek(0)
    torch.testing.assert_close(torch.load(buf, weights_only=False)(x), want)
    torch.optim.swa_utils.AveragedModel(mha)


def test_transformer_carries_state_across_segments():
    model = attnkit.Transformer(8, 2, 2, "softmax").double()
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    full = model(x, causal=True)
    a, st = model(x[:, :4], causal=True, return_state=True)
    b, st = model(x[:, 4:], causal=True, state=st, return_state=True)
    torch.testing.assert_close(torch.cat([a, b], 1), full)
    with pytest.raises(InvalidInputError, match="list of 2 block states"):
        model(x, causal=True, state=[None])
