"""The block-sparse engine against the dense reference: every CPU backend, outputs and gradients, float64.

Backends here: ``torch`` and ``numba`` (outputs and gradients of q, k, v), ``flex``
(forward only: eager FlexAttention for float64, plus one compiled float32 case).
``triton`` runs the same cases under the interpreter in test_engine_triton.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.errors import BackendUnavailableError, InvalidInputError
from attnkit.positions import Positions
from attnkit_sparse import engine
from attnkit_sparse.engine import attend, available_backends, plan, reference_attend, why_unavailable
from attnkit_sparse.engine import flex as flex_backend
from attnkit_sparse.engine.plan import check_block_size

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TOL = {torch.float64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=2e-5, rtol=2e-4)}


def _rand(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _grads(out, inputs, seed=7):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * proj).sum(), inputs)


def agree(backend, q, k, v, mask, *, block_size=16, positions=None, grads=True, ref_kv=None, scale=None):
    """Assert ``attend`` (``backend``) matches :func:`reference_attend` on the output and, with ``grads``, on
    the gradients of q, k and v. ``ref_kv``: the (k, v) the reference sees (clean values where the engine's
    inputs hold poison at padded keys)."""
    tol = TOL[q.dtype]
    leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    rk, rv = (k, v) if ref_kv is None else ref_kv
    ref_leaves = [t.detach().clone().requires_grad_(grads) for t in (q, rk, rv)]
    out = attend(*leaves, mask, scale=scale, backend=backend, block_size=block_size, positions=positions)
    ref = reference_attend(*ref_leaves, mask, scale=scale, positions=positions)
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), f"{backend}: non-finite output"
    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"{backend} output: {m}")
    if grads:
        got = _grads(out, leaves)
        want = _grads(ref, ref_leaves)
        for name, a, b in zip("qkv", got, want):
            assert torch.isfinite(a).all(), f"{backend}: non-finite d{name}"
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{backend} d{name}: {m}")


def _ids(B, L, cuts):
    ids = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for c in cuts[b % len(cuts)]:
            ids[b, c:] += 1
    return ids


def _dilated(b, h, q, kv):
    return (kv <= q) & ((q - kv) % (h + 2) == 0)


def _random_per_head(b, h, q, kv):
    return ((q * 7 + kv * 13 + h * 5) % 11 < 4) | (q == kv)


def _global(b, h, q, kv):
    return (kv < 3) | (q < 2)


def _some_empty(b, h, q, kv):
    return (q % 5 != 0) & (kv <= q)


B, H, D, E = 2, 2, 8, 6
KPM = torch.tensor([[True] * 30 + [False] * 7, [True] * 12 + [False] * 25])
CASES = {
    "none": (37, 37, lambda: None, {}),
    "causal": (37, 37, masks.causal, {}),
    "window": (37, 37, lambda: masks.sliding_window(5, 3), {}),
    "causal_window": (37, 37, lambda: masks.causal() & masks.sliding_window(20), {}),
    "key_padding": (37, 37, lambda: masks.key_padding(KPM) & masks.causal(), {}),
    "document": (37, 37, lambda: masks.document(_ids(B, 37, [(9, 30), (17,)])) & masks.causal(), {}),
    "dilated_per_head": (37, 37, lambda: masks.from_function(_dilated, head_dependent=True), {}),
    "random_per_head": (37, 37, lambda: masks.from_function(_random_per_head, head_dependent=True), {}),
    "union": (37, 37, lambda: masks.sliding_window(2) | masks.from_function(_global), {}),
    "cross": (21, 45, lambda: None, {}),
    "cross_causal": (21, 45, masks.causal, {}),
    "empty_rows": (37, 37, lambda: masks.from_function(_some_empty), {}),
    "offset": (37, 37, lambda: masks.causal() & masks.sliding_window(9), {"positions": Positions(offset=7)}),
    "per_batch_positions": (37, 37, lambda: masks.causal() & masks.sliding_window(4),
                            {"positions": Positions(q=torch.stack([torch.arange(37), torch.arange(37) % 13]))}),
    "block_8": (37, 37, lambda: masks.causal() & masks.sliding_window(6), {"block_size": 8}),
    "block_16x32": (37, 45, lambda: masks.causal() & masks.sliding_window(11), {"block_size": (16, 32)}),
}


def inputs(L, S, dtype=torch.float64, seed=0):
    return _rand((B, H, L, D), seed, dtype), _rand((B, H, S, D), seed + 1, dtype), _rand((B, H, S, E), seed + 2, dtype)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_match_the_reference(backend, case):
    L, S, make, kw = CASES[case]
    agree(backend, *inputs(L, S), make(), **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_flex_forward_matches_the_reference(case, monkeypatch):
    monkeypatch.setattr(flex_backend, "COMPILE", False)  # eager: float64 on CPU (compiled takes float32)
    L, S, make, kw = CASES[case]
    agree("flex", *inputs(L, S), make(), grads=False, **kw)


def test_flex_compiled_forward_float32():
    agree("flex", *inputs(37, 37, torch.float32), masks.causal() & masks.sliding_window(20), grads=False)


@pytest.mark.parametrize(("block", "tile"), [(16, 16), (64, 64), ((64, 32), 32), ((48, 64), 16), (128, None),
                                             (256, None)])
def test_flex_kernel_tiles_divide_the_plan_blocks_on_cuda(block, tile):
    """Compiled FlexAttention on CUDA refuses kernel tiles that do not divide the block mask's blocks (its
    defaults reach 128): below 128 the backend sets every tile, forward and backward, to one that divides both."""
    p = plan(masks.causal(), 1, 1, 300, 300, block_size=block)
    options = flex_backend.kernel_options(p, torch.device("cuda"))
    if tile is None:
        assert options is None
        return
    assert set(options) == {"fwd_BLOCK_M", "fwd_BLOCK_N", "bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2",
                            "bwd_BLOCK_N2"}
    assert set(options.values()) == {tile}
    assert all(b % tile == 0 for b in p.block_size)
    assert flex_backend.kernel_options(p, torch.device("cpu")) is None


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_float32(backend):
    agree(backend, *inputs(37, 37, torch.float32), masks.causal() & masks.sliding_window(20))


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_scale_and_value_width(backend):
    q, k, _ = inputs(37, 37)
    v = _rand((B, H, 37, 3), 9)
    agree(backend, q, k, v, masks.causal(), scale=0.3)


@pytest.mark.parametrize("backend", ["torch", "numba", "flex"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_padded_keys_have_no_influence(backend, poison, monkeypatch):
    monkeypatch.setattr(flex_backend, "COMPILE", False)
    q, k, v = inputs(37, 37)
    pad = ~KPM[:, None, :, None]
    clean = (k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0))
    bad_k, bad_v = k.masked_fill(pad, poison), v.masked_fill(pad, poison)
    agree(backend, q, bad_k, bad_v, masks.key_padding(KPM) & masks.sliding_window(8, 8), ref_kv=clean,
          grads=backend != "flex")


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_fully_masked_rows_give_zero_with_finite_gradients(backend):
    q, k, v = (t.requires_grad_() for t in inputs(37, 37))
    kpm = torch.ones(B, 37, dtype=torch.bool)
    kpm[1] = False                                   # batch element 1 has no key at all
    out = attend(q, k, v, masks.key_padding(kpm) & masks.from_function(_some_empty), backend=backend,
                 block_size=16)
    assert (out[1] == 0).all() and (out[0, :, ::5] == 0).all()
    dq, dk, dv = _grads(out, (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


# --------------------------------------------------------------- the comparison catches broken kernels
def _broken(monkeypatch, how):
    """Make :func:`plan` return a corrupted plan (dropped PARTIAL element masks or shifted key blocks)."""
    real = engine.plan

    def corrupt(*args, **kwargs):
        p = real(*args, **kwargs)
        if how == "drop_partial_masks":
            return dataclasses.replace(p, bank=torch.ones_like(p.bank), _numpy=None)
        shifted = torch.where(p.kv_idx > 0, p.kv_idx - 1, p.kv_idx)   # off by one key block
        return dataclasses.replace(p, kv_idx=shifted, _numpy=None)

    monkeypatch.setattr(engine, "plan", corrupt)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("how", ["drop_partial_masks", "off_by_one_block"])
def test_the_comparison_catches_a_broken_plan(backend, how, monkeypatch):
    _broken(monkeypatch, how)
    with pytest.raises(AssertionError):
        agree(backend, *inputs(37, 37), masks.causal() & masks.sliding_window(20))


# --------------------------------------------------------------- the plan
def test_plan_cost_is_proportional_to_attended_tiles():
    L = 32768
    m = masks.causal() & masks.sliding_window(255)
    p = plan(m, 1, 8, L, L, block_size=64)
    bq, bk = p.block_size
    nq, nk = p.num_blocks
    assert p.bank.numel() <= p.tiles * bq * bk
    assert p.kv_idx.shape[-1] <= 6 and p.q_idx.shape[-1] <= 6          # window 256 = 4 blocks (+2 partial)
    assert p.tiles <= 6 * nq
    assert p.nbytes() < L * L // 100                                     # nowhere near (L, S)
    assert p.attended_pairs == sum(min(i + 1, 256) for i in range(L))
    assert plan(m, 1, 8, L, L, block_size=64) is p                       # cached


def test_plan_tiles_match_the_block_index():
    m = masks.from_function(_random_per_head, head_dependent=True) & masks.causal()
    p = plan(m, B, H, 37, 37, block_size=16)
    bi = m.block_index(B, H, 37, 37, block_size=16)
    assert p.tiles == int((bi.state != masks.SKIP).sum())
    assert p.bank.shape[0] == int((bi.state == masks.PARTIAL).sum())
    assert p.attended_pairs == int(m.dense(attnkit.masks.Geometry(B, H, 37, 37, torch.device("cpu"))).sum())
    for b_ in range(p.index_dims[0]):                                     # transposed index: same tiles
        for h_ in range(p.index_dims[1]):
            fwd = {(qb, int(p.kv_idx[b_, h_, qb, c])) for qb in range(p.num_blocks[0])
                   for c in range(int(p.kv_count[b_, h_, qb]))}
            bwd = {(int(p.q_idx[b_, h_, kb, c]), kb) for kb in range(p.num_blocks[1])
                   for c in range(int(p.q_count[b_, h_, kb]))}
            assert fwd == bwd


@pytest.mark.parametrize("L,S,block", [(1000, 1000, (64, 64)), (300, 517, (16, 32)), (517, 300, (32, 16))])
@pytest.mark.parametrize("make", [lambda: masks.causal() & masks.sliding_window(100),
                                  lambda: masks.sliding_window(40, 17) | masks.causal()])
def test_band_tiles_share_bank_entries_and_each_tile_reads_its_exact_mask(make, L, S, block):
    m = make()
    bq, bk = block
    p = plan(m, 1, 2, L, S, block_size=block)
    dense = m.dense(attnkit.masks.Geometry(1, 2, L, S, torch.device("cpu")))[0, 0]
    n_partial = int((p.kv_tile >= 0).sum())
    assert p.bank.shape[0] <= 12 < n_partial                        # a handful of offsets, not one per tile
    assert p.attended_pairs == int(dense.sum())
    for qb in range(p.num_blocks[0]):
        for c in range(int(p.kv_count[0, 0, qb])):
            kb, t = int(p.kv_idx[0, 0, qb, c]), int(p.kv_tile[0, 0, qb, c])
            want = torch.zeros(bq, bk, dtype=torch.bool)
            tile = dense[qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            want[:tile.shape[0], :tile.shape[1]] = tile
            if t == -1:                                              # FULL: every pair inside L x S
                got = torch.zeros(bq, bk, dtype=torch.bool)
                got[:tile.shape[0], :tile.shape[1]] = True
            else:
                got = p.bank[t]
            assert torch.equal(got, want), (qb, kb, t)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_long_sparse_sequence_runs_in_memory_of_the_attended_tiles(backend):
    L = 16384                                         # an (L, L) float64 score matrix would be 2 GiB
    q, k, v = (_rand((1, 1, L, 4), s) for s in range(3))
    m = masks.causal() & masks.sliding_window(31)
    p = plan(m, 1, 1, L, L, block_size=32)
    assert p.kv_idx.shape[-1] == 2 and p.bank.numel() <= p.tiles * 32 * 32 and p.nbytes() < 4 << 20
    out = attend(q, k, v, m, backend=backend, block_size=32)
    tail = slice(L - 40, L)
    ref = reference_attend(q[:, :, tail], k[:, :, L - 80:], v[:, :, L - 80:], masks.causal() & masks.sliding_window(31))
    torch.testing.assert_close(out[:, :, tail], ref, **TOL[torch.float64])


# --------------------------------------------------------------- errors and availability
def test_additive_masks_are_refused():
    q, k, v = inputs(8, 8)
    bias = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")) + 0.5
    with pytest.raises(InvalidInputError, match="mask.*bool masks"):
        attend(q, k, v, masks.from_tensor(bias), backend="torch")
    keep = torch.ones(8, 8, dtype=torch.bool).tril()                    # a bool tensor mask is honoured
    agree("numba", q, k, v, masks.from_tensor(keep), block_size=4)


def test_bad_arguments_are_named():
    q, k, v = inputs(8, 8)
    with pytest.raises(InvalidInputError, match="block_size"):
        attend(q, k, v, None, block_size=0)
    with pytest.raises(InvalidInputError, match="backend"):
        attend(q, k, v, None, backend="cuda")
    with pytest.raises(InvalidInputError, match="k \\(B, H, S, D\\)"):
        attend(q, k[..., :3], v, None)
    with pytest.raises(InvalidInputError, match="mask"):
        attend(q, k, v, torch.ones(8, 8, dtype=torch.bool))


def test_flex_refuses_gradients_on_cpu_naming_the_backends_that_train():
    q, k, v = (t.requires_grad_() for t in inputs(8, 8, torch.float32))
    with pytest.raises(BackendUnavailableError, match="no CPU backward.*'numba' and 'torch'"):
        attend(q, k, v, masks.causal(), backend="flex")


def test_availability():
    cpu = torch.device("cpu")
    assert {"torch", "numba", "flex"} <= set(available_backends(cpu))
    assert why_unavailable("numba", "cuda") is not None
    # on CPU triton runs only in the interpreter (or is not installed at all, as in the plugin's own session)
    reason = why_unavailable("triton", cpu)
    assert reason is None or "TRITON_INTERPRET" in reason or "not installed" in reason
    assert engine.auto_backend(cpu) == "numba"
    assert set(engine.BACKENDS) == {"torch", "numba", "flex", "triton"}


def test_flex_on_cuda_defaults_to_128_blocks_and_refuses_training_through_smaller_ones():
    assert engine.flex_cuda_block_size(None, True) == (128, None)
    assert engine.flex_cuda_block_size((128, 256), True) == ((128, 256), None)
    assert engine.flex_cuda_block_size(64, False) == (64, None)            # the forward runs at 64 (kernel tiles)
    size, reason = engine.flex_cuda_block_size(64, True)
    assert size == 64 and "block_size=64" in reason and "'triton'" in reason and "128" in reason


def test_auto_prefers_triton_then_flex_on_cuda(monkeypatch):
    """The measured order on CUDA (an H100, docs/benchmarks.md): triton, else FlexAttention, else torch."""
    gone: set[str] = set()
    monkeypatch.setattr(engine, "why_unavailable", lambda b, d: "absent" if b in gone else None)
    assert engine.auto_backend("cuda") == "triton"
    gone.add("triton")
    assert engine.auto_backend("cuda") == "flex"
    gone.add("flex")
    assert engine.auto_backend("cuda") == "torch"
    assert engine.BACKENDS[:2] == ("triton", "flex")


def test_pattern_modules_try_flex_before_triton_for_float32_on_cuda(monkeypatch):
    """float32 on CUDA: flex first (the triton backward measured 4-7x slower there); half precision: triton."""
    import attnkit
    from attnkit import backends as core_backends

    local = attnkit.build("local", window=8)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert local.backend_order(cuda, torch.float32)[:2] == ("flex", "triton")
    assert local.backend_order(cuda, torch.bfloat16)[:2] == ("triton", "flex")
    assert local.backend_order(cuda, torch.float64)[:2] == ("triton", "flex")
    assert local.backend_order(cpu, torch.float32) == tuple(local.caps.backends)
    monkeypatch.setattr(core_backends, "why_unavailable", lambda b, d, forced=False: None)   # as if on a GPU
    for dtype, expected in ((torch.float32, "flex"), (torch.bfloat16, "triton")):
        got = core_backends.select_backend(implementation="local", offered=local._auto_order(cuda, dtype),
                                           requested="auto", device=cuda, needs_grad=True)
        assert got == expected


def test_numba_custom_op_passes_opcheck():
    from attnkit_sparse.engine import numba_ops
    q, k, v = (t.requires_grad_() for t in inputs(20, 20))
    p = plan(masks.causal(), B, H, 20, 20, block_size=8)
    args = (q, k, v, p.kv_count, p.kv_idx, p.kv_tile, p.q_count, p.q_idx, p.q_tile, p.q_slot, p.key_major_bank(),
            p.span, 8, 8, 0.5)
    torch.library.opcheck(numba_ops.numba_block_attention, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("budget_tiles", [0, 3])
def test_numba_backward_in_passes_when_the_ds_buffer_is_over_budget(monkeypatch, budget_tiles):
    """Above DS_BUFFER_MAX_BYTES the two-kernel backward runs in passes over ranges of query blocks, each with a
    dS buffer of its own blocks (one block per pass at a budget of 0): same gradients as the reference, and more
    than one pass ran."""
    from attnkit_sparse.engine import numba_ops
    monkeypatch.setattr(numba_ops, "FUSED_BACKWARD", False)
    ranges = []
    real = numba_ops.K.backward_dq_from_ds

    def dq_pass(*a):  # called once per range of work items: a pass's (qlo, qhi) once
        if not ranges or ranges[-1] != (a[4], a[5]):
            ranges.append((a[4], a[5]))
        real(*a)

    monkeypatch.setattr(numba_ops.K, "backward_dq_from_ds", dq_pass)
    for case in ("causal_window", "random_per_head", "empty_rows", "block_16x32"):
        L, S, make, kw = CASES[case]
        tile = check_block_size(kw.get("block_size", 16))
        budget = budget_tiles * B * H * tile[0] * tile[1] * 8  # float64 inputs
        monkeypatch.setattr(numba_ops, "DS_BUFFER_MAX_BYTES", budget)
        ranges.clear()
        agree("numba", *inputs(L, S), make(), **kw)
        nq = -(-L // tile[0])
        lo = [r[0] for r in ranges]
        assert len(ranges) > 1 and lo[0] == 0 and ranges[-1][1] == nq, (case, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "the passes cover the blocks in order"
        if budget_tiles == 0:
            assert all(b - a == 1 for a, b in ranges), "a budget of 0: one query block per pass"


def test_ds_passes_hold_the_budget():
    """``_passes``: contiguous ranges covering every query block, each within the budget unless it is one block,
    each buffer sized for the most tiles a pattern row visits in it."""
    from attnkit_sparse.engine import numba_ops
    counts = torch.tensor([[1, 2, 3, 0, 5, 1], [2, 2, 1, 4, 1, 0]])
    for budget in (0, 1, 4, 6, 100):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(numba_ops, "DS_BUFFER_MAX_BYTES", budget)
            passes = numba_ops._passes(counts, 1)
        assert passes[0][0] == 0 and passes[-1][1] == 6
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(passes, passes[1:]))
        for lo, hi, tiles in passes:
            assert tiles == int(counts[:, lo:hi].sum(-1).max())
            if hi - lo > 1:
                assert int(counts.max(0).values[lo:hi].sum()) <= budget
    with pytest.MonkeyPatch.context() as m:
        m.setattr(numba_ops, "DS_BUFFER_MAX_BYTES", 100)
        assert numba_ops._passes(counts, 1) == [(0, 6, 12)]


@pytest.mark.parametrize("fused", [True, False])
def test_numba_backward_one_kernel_per_sequence_and_the_two_kernel_path(monkeypatch, fused):
    """Both backward paths (``backward_sequence``: dQ, dK, dV per sequence in one call; ``backward_dkdv`` then dQ from
    the dS buffer) match the reference, ragged lengths, padding and empty rows included."""
    from attnkit_sparse.engine import numba_ops
    monkeypatch.setattr(numba_ops, "FUSED_BACKWARD", fused)
    calls = []
    for name in ("backward_sequence", "backward_dkdv"):
        kernel = getattr(numba_ops.K, name)
        monkeypatch.setattr(numba_ops.K, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    for L, S, make, kw in CASES.values():
        agree("numba", *inputs(L, S), make(), **kw)
    assert calls and set(calls) == {"backward_sequence" if fused else "backward_dkdv"}


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_a_nan_query_gives_nan_in_its_own_row_only(backend):
    q, k, v = inputs(37, 37)
    q[0, 0, 20] = float("nan")
    m = masks.causal() & masks.sliding_window(20)
    out = attend(q, k, v, m, backend=backend, block_size=16)
    assert torch.isnan(out[0, 0, 20]).all()
    clean = torch.ones_like(out, dtype=torch.bool)
    clean[0, 0, 20] = False
    ref = reference_attend(q.nan_to_num(), k, v, m)
    torch.testing.assert_close(out[clean], ref[clean], **TOL[torch.float64])


def test_numba_op_traces_in_torch_compile_fullgraph():
    """torch.compile sees the numba kernels as one operator (no graph break), forward and backward."""
    from attnkit_sparse.engine import numba_ops
    q, k, v = (t.requires_grad_() for t in inputs(40, 40, torch.float32))
    m = masks.causal() & masks.sliding_window(15)
    p = plan(m, B, H, 40, 40, block_size=16)

    def loss(q, k, v):
        out, _ = numba_ops.numba_block_attention(q, k, v, p.kv_count, p.kv_idx, p.kv_tile, p.q_count, p.q_idx,
                                                 p.q_tile, p.q_slot, p.key_major_bank(), p.span, 16, 16, 0.25)
        return (out * out).sum()

    # no on-disk compile caches: an entry compiled against an older schema of the operator (this machine's
    # shared /tmp cache) was replayed once with the old argument order
    import torch._inductor.config as inductor_config
    with inductor_config.patch(force_disable_caches=True):
        got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    want = torch.autograd.grad((reference_attend(q, k, v, m, scale=0.25) ** 2).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numba_tile_mask_sets_forbidden_scores_to_minus_inf_whatever_they_hold(dtype):
    """The numba kernels' tile mask (unconditional ``fmin`` stores, not masked stores): a forbidden score becomes
    -inf whether it held a number, +-inf or NaN; an allowed one keeps its value bit for bit (NaN and +-inf
    included); rows past ``kn`` and columns past ``qn`` are not touched."""
    import numba
    import numpy as np

    from attnkit_sparse.engine import _numba_kernels as K

    @numba.njit
    def apply(ST, kn, qn, bankT, t, cst):
        K._apply_tile_mask(ST, kn, qn, bankT, t, cst)

    rng = np.random.default_rng(0)
    kn, qn = 7, 13
    ST = rng.standard_normal((9, 16)).astype(dtype)
    ST[1, ::3] = np.nan
    ST[2, ::4] = np.inf
    ST[3, 1::4] = -np.inf
    bankT = rng.random((2, 9, 16)) < 0.5                      # entry 1 is the one applied
    before = ST.copy()
    apply(ST, kn, qn, bankT, 1, K.constants(np.dtype(dtype), 0.5))
    keep = bankT[1, :kn, :qn]
    inner = ST[:kn, :qn]
    assert (inner[~keep] == -np.inf).all()
    np.testing.assert_array_equal(inner[keep], before[:kn, :qn][keep])      # NaN compares equal here
    np.testing.assert_array_equal(ST[kn:], before[kn:])
    np.testing.assert_array_equal(ST[:, qn:], before[:, qn:])
