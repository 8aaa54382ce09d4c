"""torch.export with a dynamic length (``Capabilities.export_dynamic``): one program for every length.

Under a dynamic length (``attnkit.transforms.symbolic``) linformer slices its projections always, the window
mechanisms (memory-compressed, soft) take their window count from ``chunk_count``, nystrom its default landmark
count as an unbacked ``min(64, L)`` with the landmarks from ``segment_weights``, poolingformer and luna's causal
forms batch their query chunks. Lengths an instance's limits refuse (a window or a landmark count that does not
fit: ``common.ShortestLengths``) are refused by the program too. informer's sample counts ``c·ln L`` fix the
length. The conformance kit checks each declared spec at five lengths; here more lengths, across the window,
chunk and landmark boundaries, and the batched forms against the loops directly.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from attnkit_lowrank.common import ShortestLengths, window_count, windows

import attnkit

DECLARED = ("linformer", "memory-compressed", "soft", "nystrom", "poolingformer", "luna", "isab")


class _Call(torch.nn.Module):
    def __init__(self, attn, causal: bool) -> None:
        super().__init__()
        self.attn, self.causal = attn, causal

    def forward(self, q, k, v, kpm=None):
        if kpm is None:
            return self.attn(q, k, v, causal=self.causal)
        return self.attn(q, k, v, causal=self.causal, key_padding_mask=kpm)


def _args(n: int, seed: int, padded: bool):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    if not padded:
        return q, k, v
    kpm = torch.ones(2, n, dtype=torch.bool)
    kpm[1, n - n // 3:] = False
    kpm[0, :n // 4] = False
    return q, k, v, kpm


def _export(name: str, options: dict, causal: bool, padded: bool, top: int = 4096):
    torch.manual_seed(0)
    module = _Call(attnkit.build(name, num_heads=2, head_dim=8, **options).double().eval(), causal)
    L = torch.export.Dim("L", min=1, max=top)
    shapes = ({2: L},) * 3 + (({1: L},) if padded else ())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, _args(24, 0, padded), dynamic_shapes=shapes).module()
    return module, program


@pytest.mark.parametrize("name", DECLARED)
def test_declared(name):
    assert attnkit.get_spec(name).capabilities.export_dynamic == ("torch",)


@pytest.mark.parametrize("name,options,causal,padded,lengths", [
    ("linformer", {"proj_len": 5, "max_length": 256}, False, False, (1, 2, 255, 256)),
    ("linformer", {"proj_len": 4, "max_length": 130, "per_head": True, "share_kv": True}, False, False, (1, 130)),
    ("memory-compressed", {}, False, False, (3, 4, 5, 6, 131)),
    ("memory-compressed", {"stride": 2, "compression": "pool"}, True, False, (2, 3, 4, 65)),
    ("soft", {}, False, False, (1, 2, 63, 64, 65, 129)),
    ("soft", {"stride": 3, "bottleneck": "pool"}, False, False, (3, 4, 5, 67)),
    ("nystrom", {}, False, True, (1, 2, 63, 64, 65, 200)),
    ("nystrom", {"num_landmarks": 3, "conv_kernel_size": 3}, False, False, (3, 4, 7, 67)),
    ("poolingformer", {"window": 4, "pool_window": 6, "pool_size": 3, "pool_stride": 2, "chunk_size": 3}, True,
     False, (1, 2, 3, 4, 5, 6, 7, 40)),
    ("poolingformer", {"window": 2, "pool_window": 8, "pool_size": 4, "pool_stride": 4, "chunk_size": 5}, False,
     False, (1, 4, 5, 6, 9, 41)),
    ("luna", {"packed_len": 3, "chunk_size": 4}, True, True, (1, 3, 4, 5, 9, 40)),
    ("luna", {"packed_len": 3, "chunk_size": 4, "causal_form": "prefix-softmax"}, True, True, (1, 3, 4, 5, 9, 40)),
])
def test_one_program_equals_eager_at_every_length(name, options, causal, padded, lengths):
    """Exported at L = 24, the program gives the eager output at lengths below, at and across the window, chunk
    and landmark boundaries (float64)."""
    top = options.get("max_length", 4096)
    module, program = _export(name, options, causal, padded, top)
    for n in lengths:
        args = _args(n, n, padded and n > 1)
        if padded and n == 1:
            args = (*args, torch.ones(2, 1, dtype=torch.bool))
        with torch.no_grad():
            torch.testing.assert_close(program(*args), module(*args), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name,options,short", [
    ("memory-compressed", {"stride": 3}, 2),
    ("soft", {"stride": 4, "bottleneck": "pool"}, 3),
    ("nystrom", {"num_landmarks": 3}, 2),
])
def test_programs_refuse_what_the_limits_refuse(name, options, short):
    """A length shorter than a window or a landmark count: the eager forward refuses it (its limits), the program
    (exported without a lower bound on the length) raises when it runs."""
    module, program = _export(name, options, False, False)
    args = _args(short, 1, False)
    assert module.attn.limits.why_not(short, short) is not None
    with pytest.raises(attnkit.UnsupportedFeatureError, match="beyond its limit"):
        module(*args)
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        program(*args)
    longer = _args(short + 1, 2, False)
    torch.testing.assert_close(program(*longer), module(*longer), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
def test_informer_fixes_the_length(causal):
    """informer samples c·ln(L) keys and queries: its program is one length's (torch.export reports the
    dimension as specialised), and it is not declared."""
    assert "torch" not in attnkit.get_spec("informer").capabilities.export_dynamic
    with pytest.raises(Exception, match="Constraints violated"):
        _export("informer", {"factor": 1}, causal, False)


def test_shortest_lengths_keep_the_other_limits_and_accept_empty_sequences():
    nystrom = attnkit.build("nystrom", num_landmarks=4, conv_kernel_size=3, num_heads=2).limits
    assert isinstance(nystrom, ShortestLengths) and nystrom.equal_length
    assert nystrom.why_not(3, 3) is not None and nystrom.why_not(4, 4) is None
    assert "L must equal S" in nystrom.why_not(5, 6)
    assert nystrom.why_not(0, 0) is None and nystrom.why_not(0, 5) is None     # the base's empty exception
    mca = attnkit.build("memory-compressed", stride=3, compression="pool").limits
    assert mca.why_not(1, 3) is None and mca.why_not(9, 2) is not None and mca.why_not(4, 0) is None
    # no shortest length: the plain limits
    assert type(attnkit.build("soft", bottleneck="pool").limits) is attnkit.Limits
    assert type(attnkit.build("nystrom").limits) is attnkit.Limits


def test_windows_pad_and_split():
    x = torch.arange(7.0).view(1, 1, 7, 1)
    assert window_count(7, 3) == 3 and window_count(6, 3) == 2 and window_count(5, 1) == 5
    assert windows(x, 3).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0]
    assert windows(x, 7).shape == (1, 1, 1, 7, 1) and windows(x, 1).shape == (1, 1, 7, 1, 1)


@pytest.mark.parametrize("form", ["paper", "prefix-softmax"])
def test_luna_batched_causal_forms_equal_the_chunk_loops(form):
    """The batched causal forms (taken under a dynamic-length export) against the loops, in float64: chunk sizes
    1 to 16, lengths across chunk boundaries, right and left padding, holes, a row with no real key, and large
    scores (inputs x30: the prefix softmax's log-cumulative-sum-exp carries neither overflow nor 0/0)."""
    torch.manual_seed(0)
    for c in (1, 2, 5, 16):
        attn = attnkit.build("luna", num_heads=2, head_dim=8, packed_len=3, chunk_size=c, causal_form=form).double()
        loop = attn.paper_causal_unpack if form == "paper" else attn.causal_unpack
        batched = attn.paper_causal_unpack_batched if form == "paper" else attn.causal_unpack_batched
        p = attn.packed.detach()
        for n in (1, 3, 7, 16, 33):
            for size in (1.0, 30.0):
                q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) * size for _ in range(3))
                keeps = [None, torch.ones(2, n, dtype=torch.bool)]
                keeps[1][0, :n // 2] = False
                keeps[1][1, ::2] = False
                keeps.append(torch.zeros(2, n, dtype=torch.bool))
                for keep in keeps:
                    want = loop(q, p, k, v, 0.35, keep)
                    torch.testing.assert_close(batched(q, p, k, v, 0.35, keep), want, rtol=1e-9, atol=1e-10)


def test_poolingformer_batched_levels_equal_the_chunk_loop():
    """The batched levels (taken under a dynamic-length export) against the chunk loop for random windows,
    segments and chunk sizes at lengths 1 to 40, and the defaults past their windows (float64)."""
    rng = random.Random(0)
    configs = [{}]
    for _ in range(10):
        ps = rng.randint(1, 6)
        configs.append({"window": rng.randint(1, 9), "pool_window": rng.randint(ps, 14), "pool_size": ps,
                        "pool_stride": rng.randint(1, ps), "chunk_size": rng.randint(1, 7)})
    for options in configs:
        attn = attnkit.build("poolingformer", **options).double()
        for n in ((1, 255, 256, 257, 700) if not options else range(1, 41)):
            q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for _ in range(3))
            for causal in (False, True):
                want = attn._levels(q, k, v, torch.arange(n), causal)
                torch.testing.assert_close(attn._levels_batched(q, k, v, causal), want, rtol=1e-9, atol=1e-11)
