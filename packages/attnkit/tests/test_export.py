"""``torch.export``: ``Capabilities.export`` / ``export_masks``, the refusals, and ``attnkit.caching.outside_trace``."""

from __future__ import annotations

import warnings

import pytest
import torch
from broken_impls import NaiveAttention

import attnkit
from attnkit import Capabilities
from attnkit.caching import cached, outside_trace, reads_traced
from attnkit.errors import InvalidInputError, UnsupportedFeatureError


class _Call(torch.nn.Module):
    def __init__(self, attn, **kw):
        super().__init__()
        self.attn, self.kw = attn, kw

    def forward(self, q, k, v, kpm=None):
        return self.attn(q, k, v, **self.kw, **({} if kpm is None else {"key_padding_mask": kpm}))


def _export(module, *args):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args)


def _qkv(L=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, L, 4, generator=g) for _ in range(3))


def test_softmax_exports_with_a_key_padding_input_and_runs_on_other_masks():
    m = _Call(attnkit.build("softmax").eval(), causal=True)
    kpm = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    program = _export(m, *_qkv(), kpm).module()
    other = torch.tensor([[True] * 2 + [False] * 4, [True] * 6])
    with torch.no_grad():
        for mask, xs in ((kpm, _qkv()), (other, _qkv(seed=1))):
            torch.testing.assert_close(program(*xs, mask), m(*xs, mask), rtol=0, atol=1e-6)


class _AttnMaskCall(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v, m):
        return self.attn(q, k, v, attn_mask=m)


def test_an_additive_attn_mask_input_exports_runs_on_other_masks_and_the_program_refuses_nan():
    """A float ``attn_mask`` as a program input: exporting read its values on the host (the NaN check, the ``-inf``
    split) and failed on a data-dependent guard; now the program keeps the general form (so a mask without
    ``-inf`` and one with it both give eager's output) and checks NaN / +inf when it runs."""
    m = _AttnMaskCall(attnkit.build("softmax").eval())
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(4)
    finite = torch.randn(2, 1, 6, 6, generator=g)
    with_inf = finite.masked_fill(torch.rand(2, 1, 6, 6, generator=g) < 0.3, float("-inf"))
    with_inf[..., 0] = 0.0
    program = _export(m, q, k, v, finite).module()
    with torch.no_grad():
        for mask in (finite, with_inf):
            torch.testing.assert_close(program(q, k, v, mask), m(q, k, v, mask), rtol=0, atol=1e-6)
    bad = finite.clone()
    bad[1, 0, 2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="attn_mask.*NaN or \\+inf"):
        program(q, k, v, bad)
    with pytest.raises(InvalidInputError, match="attn_mask.*NaN or \\+inf"):
        m(q, k, v, bad)


def test_export_masks_is_derived_from_the_mask_kinds():
    assert Capabilities().export_masks == ()
    assert Capabilities(export=True).export_masks == ("key_padding",)
    assert Capabilities(export=True, attn_mask=True).export_masks == ("key_padding", "tensor", "document", "function")
    assert Capabilities(export=True, export_masks=["key_padding"]).export_masks == ("key_padding",)
    assert Capabilities(export=True, export_masks=()).export_masks == ()


@pytest.mark.parametrize("fields", [
    {"export": True, "export_masks": "key_padding"},               # a string, not a tuple
    {"export": True, "export_masks": ("causal",)},                 # holds no tensor
    {"export": True, "export_masks": ("tensor",)},                 # not among its mask kinds
    {"export": False, "export_masks": ("key_padding",)},           # without export
    {"export": "yes"},
    {"export": True, "export_dynamic": "torch"},                   # a string, not a tuple
    {"export": True, "export_dynamic": ("numba",)},                # not among export_backends
    {"export": False, "export_dynamic": ("torch",)},               # without export
])
def test_capabilities_refuse_bad_export_declarations(fields):
    with pytest.raises(InvalidInputError, match=r"Capabilities\.export"):
        Capabilities(**fields)


def test_export_dynamic_names_backends_of_export_backends():
    assert Capabilities().export_dynamic == ()
    assert Capabilities(export=True, export_dynamic=["torch"]).export_dynamic == ("torch",)
    assert attnkit.get_spec("softmax").capabilities.export_dynamic == ("sdpa", "torch")


def test_symbolic_is_true_only_for_a_dynamic_size_while_exporting():
    from attnkit.transforms import symbolic

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((symbolic(x.shape[0]), symbolic(x.shape[1])))
            return x * 2

    assert not symbolic(5)
    _ = torch.export.export(Probe(), (torch.randn(6, 3),), dynamic_shapes=({0: torch.export.Dim("n", max=64)},))
    assert seen[-1] == (True, False)        # the dynamic dimension, not the static one
    Probe()(torch.randn(6, 3))
    assert seen[-1] == (False, False)       # eager


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunk_count_in_a_program_is_the_ceiling_at_every_length(chunk):
    from attnkit.transforms import chunk_count, symbolic

    class Chunks(torch.nn.Module):
        def forward(self, x):
            L = x.shape[1]
            N = chunk_count(L, chunk) if symbolic(L) else -(-L // chunk)
            padded = torch.nn.functional.pad(x, (0, N * chunk - L))
            return padded.reshape(x.shape[0], N, chunk).sum(-1)        # one sum per chunk

    n = torch.export.Dim("n", min=1, max=1000)
    program = torch.export.export(Chunks(), (torch.randn(2, 10),), dynamic_shapes=({1: n},)).module()
    for L in (1, 2, chunk, chunk + 1, 200):
        x = torch.randn(2, L)
        got = program(x)
        assert got.shape == (2, -(-L // chunk))
        torch.testing.assert_close(got, Chunks()(x))


def test_a_dynamic_length_softmax_program_equals_eager_at_other_lengths():
    m = _Call(attnkit.build("softmax").eval(), causal=True)
    L = torch.export.Dim("L", min=1, max=1024)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(m, _qkv(6), dynamic_shapes=({2: L}, {2: L}, {2: L})).module()
    with torch.no_grad():
        for n in (1, 7, 100):
            torch.testing.assert_close(program(*_qkv(n, seed=n)), m(*_qkv(n, seed=n)), rtol=0, atol=1e-6)


def test_undeclared_export_is_refused_with_the_implementations_that_declare_it():
    with attnkit.registered(NaiveAttention, name="no-export", exact=True, capabilities=Capabilities()):
        m = _Call(attnkit.build("no-export").eval())
        with pytest.raises(UnsupportedFeatureError, match=r"'no-export' does not support torch\.export.*softmax"):
            _export(m, *_qkv())


def test_a_mask_input_of_an_undeclared_kind_is_refused_and_a_constant_mask_is_not():
    caps = Capabilities(export=True, export_masks=())
    with attnkit.registered(NaiveAttention, name="no-mask-export", exact=True, capabilities=caps):
        attn = attnkit.build("no-mask-export").eval()
        kpm = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
        with pytest.raises(UnsupportedFeatureError, match=r"a key_padding mask among the inputs of torch\.export"):
            _export(_Call(attn), *_qkv(), kpm)
        # the same mask held by the module (a constant of the program) needs no declaration
        const = _Call(attn, key_padding_mask=kpm)
        program = _export(const, *_qkv()).module()
        with torch.no_grad():
            torch.testing.assert_close(program(*_qkv(seed=2)), const(*_qkv(seed=2)), rtol=0, atol=1e-6)


def test_a_forced_backend_not_in_export_backends_is_refused_while_exporting():
    caps = Capabilities(export=True, backends=("torch", "kitfake"))
    with attnkit.registered(NaiveAttention, name="forced-export", exact=True, capabilities=caps):
        m = _Call(attnkit.build("forced-export", backend="kitfake").eval())
        with pytest.raises(UnsupportedFeatureError, match=r"torch\.export with backend='kitfake'.*\('torch',\)"):
            _export(m, *_qkv())


class _Seen(NaiveAttention):
    """Records the backend each call ran."""

    def _attend(self, q, k, v, ctx):
        type(self).seen.append(ctx.backend)
        return NaiveAttention._forward(self, q, k, v, causal=ctx.causal, key_padding_mask=ctx.key_padding_mask,
                                       attn_mask=None)


def test_auto_runs_the_first_export_backend_in_its_order_while_exporting():
    _Seen.seen = []
    caps = Capabilities(export=True, backends=("kitfast", "kitother", "torch"), export_backends=("kitother", "torch"))
    with attnkit.registered(_Seen, name="seen-export", exact=True, capabilities=caps):
        m = _Call(attnkit.build("seen-export").eval())
        _export(m, *_qkv())
        assert _Seen.seen == ["kitother"]                 # kitfast comes first, but an export cannot hold it
        assert Capabilities(export=True).export_backends == ("torch",)
        assert Capabilities().export_backends == ()
    for bad in ({"export": True, "export_backends": ("numba",)}, {"export": False, "export_backends": ("torch",)},
                {"export": True, "export_backends": "torch"}):
        with pytest.raises(InvalidInputError, match=r"Capabilities\.export_backends"):
            Capabilities(**bad)


_TABLES: dict[bool, dict] = {}


class _Cached(torch.nn.Module):
    """Keeps a per-length table built on the first call (inside ``outside_trace`` when ``outside``)."""

    def __init__(self, outside: bool):
        super().__init__()
        self.outside = outside
        _TABLES[outside] = {}   # kept outside the module: torch.export restores the module's attributes after it

    @property
    def table(self):
        return _TABLES[self.outside]

    def forward(self, x):
        L = x.shape[-1]
        if L not in self.table:
            if self.outside:
                with outside_trace() as left:
                    self.table[L] = (torch.arange(L, dtype=x.dtype), left)
            else:
                self.table[L] = (torch.arange(L, dtype=x.dtype), False)
        return x + self.table[L][0]


def test_outside_trace_builds_a_real_cache_during_export_and_nothing_changes_in_eager():
    from torch._subclasses.fake_tensor import is_fake

    m = _Cached(outside=True)
    program = _export(m, torch.zeros(3, 5)).module()
    table, left = m.table[5]
    assert left and not is_fake(table)
    torch.testing.assert_close(program(torch.ones(3, 5)), torch.ones(3, 5) + torch.arange(5.0))
    assert m(torch.ones(3, 5)).sum().item() == 15 + 3 * 10          # eager afterwards: the real table
    with outside_trace() as left:                                     # no trace: a no-op
        assert not left
    bad = _Cached(outside=False)
    _export(bad, torch.zeros(3, 5))
    assert is_fake(bad.table[5][0])          # what outside_trace prevents: a fake tensor kept after the trace


def test_cached_builds_once_keeps_real_ordinary_tensors_and_nothing_made_under_a_transform():
    from torch._subclasses.fake_tensor import is_fake

    calls = []

    def build(n: int) -> torch.Tensor:
        calls.append(n)
        return torch.arange(float(n))

    cache: dict = {}
    first = cached(cache, 3, lambda: build(3))
    assert cached(cache, 3, lambda: build(3)) is first and calls == [3]        # a hit: no second build
    assert cached(cache, None, lambda: build(4)).tolist() == [0, 1, 2, 3]      # key None: built, never kept
    assert list(cache) == [3] and calls == [3, 4]
    with torch.inference_mode():
        made = cached(cache, 5, lambda: build(5))
    assert not made.is_inference()                                             # a later training call may save it
    for n in range(6, 9):                                                      # limit: cleared when over it
        cached(cache, n, lambda n=n: build(n), limit=2)
    assert sorted(cache) == [7, 8]

    def under_grad(x):                                                         # a build reading the transform's input
        return (x * cached(cache, "grad", lambda: x.detach() * 0 + 1)).sum()

    torch.func.grad(under_grad)(torch.ones(3))
    assert "grad" not in cache                                                 # its wrapper served that call alone
    under_grad(torch.ones(3))
    assert not torch._C._functorch.is_functorch_wrapped_tensor(cache["grad"])

    class Traced(torch.nn.Module):                                             # built on real tensors under export
        def forward(self, x):
            return x + cached(cache, ("trace", x.shape[-1]), lambda: torch.arange(float(x.shape[-1])))

    _export(Traced(), torch.zeros(2, 4))
    assert not is_fake(cache[("trace", 4)])


def _with_empty_cell():
    def f():
        return later
    return f       # `later` is bound only below, never reached: f's closure cell stays empty
    later = 1


def test_reads_traced_finds_traced_tensors_in_masks_and_closures():
    found = {}
    const = torch.ones(2, 4, dtype=torch.bool)                        # made outside the trace: a real tensor

    class Probe(torch.nn.Module):
        def forward(self, x, kpm):
            keep = kpm
            fn_mask = attnkit.masks.from_function(lambda b, h, q, kv: keep[b, kv], batch_dependent=True)
            found["kpm"] = reads_traced(attnkit.masks.key_padding(kpm))
            found["function"] = reads_traced(fn_mask)
            found["causal"] = reads_traced(attnkit.masks.causal(), None, 3, "text")
            found["constant"] = reads_traced(attnkit.masks.key_padding(const))
            found["empty cell"] = reads_traced(_with_empty_cell())
            found["positions"] = reads_traced(attnkit.Positions(kpm.long().cumsum(-1)))   # a slotted object
            return x * 2

    _export(Probe(), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))
    assert found == {"kpm": True, "function": True, "causal": False, "constant": False, "empty cell": False,
                     "positions": True}
    assert not reads_traced(torch.zeros(1))                           # no trace: nothing is traced
