"""Shared fixtures: toy mechanisms registered only for the test that asks for them."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import Attention, Capabilities


class NoisySoftmax(Attention):
    """Exact attention plus noise of relative size 1/sqrt(num_features) (a fake approximation).

    Args:
        num_features: the budget; more features, less noise.
        seed: noise seed.
    """

    def __init__(self, *, num_heads=None, head_dim=None, scale=None, backend="auto", num_features: int = 16,
                 seed: int | None = None):
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.num_features = num_features

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(self.num_features)).to(out)
        return out + noise * out.std() / self.num_features ** 0.5


class EvenOnly(Attention):
    """Exact attention that refuses lengths that are not a multiple of 32 (like block-sparse layouts)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if q.shape[-2] % 32:
            raise attnkit.InvalidInputError(f"even-only: length must be a multiple of 32, got {q.shape[-2]}")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Slow(Attention):
    """Exact attention that sleeps 10 ms × (L/16)²."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        time.sleep(0.01 * (q.shape[-2] / 16) ** 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class CompilesOnce(Attention):
    """Exact attention whose first call is slow (like a numba kernel compiling), later calls fast."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.3)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Hungry(Attention):
    """Runs out of memory from length 64 on."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if q.shape[-2] >= 64:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class NonCausal(Attention):
    """Exact attention that refuses causal=True (capabilities say so)."""

    capabilities = Capabilities(causal=False)

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return F.scaled_dot_product_attention(q, k, v)


class Interrupting(Attention):
    """Exact attention that raises an interrupt when ``when(q)`` says so.

    ``kind``: ``"keyboard"`` raises KeyboardInterrupt; ``"systemerror"`` raises
    a SystemError whose ``__cause__`` is a KeyboardInterrupt, and
    ``"systemerror-context"`` one whose ``__context__`` is (how Ctrl-C inside
    a numba kernel reaches Python). Set both on the class for a test.
    """

    kind = "keyboard"
    when = staticmethod(lambda q: False)
    calls = 0

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        type(self).calls += 1
        if type(self).when(q):
            raise_interrupt(type(self).kind)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def raise_interrupt(kind: str) -> None:
    if kind == "keyboard":
        raise KeyboardInterrupt
    msg = "<CPUDispatcher(causal_kernel)> returned a result with an exception set"
    if kind == "systemerror":
        raise SystemError(msg) from KeyboardInterrupt()
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise SystemError(msg)  # noqa: B904 - only the implicit __context__, as numba leaves it


class FixedApprox(Attention):
    """An approximation without a budget option (like linear attention with the elu map)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out + 0.01 * out.std()


@pytest.fixture
def toy_mechanisms():
    """Register the toy mechanisms for one test; always unregistered after."""
    regs = [
        (NoisySoftmax, dict(name="toy-noisy", summary="noisy softmax", approximation="softmax + noise")),
        (EvenOnly, dict(name="toy-even", summary="refuses odd lengths", exact=True)),
        (Slow, dict(name="toy-slow", summary="slow", exact=True)),
        (CompilesOnce, dict(name="toy-compiles", summary="slow first call", exact=True)),
        (Hungry, dict(name="toy-hungry", summary="OOM from L=64", exact=True)),
        (NonCausal, dict(name="toy-noncausal", summary="non-causal only", exact=True)),
        (Interrupting, dict(name="toy-interrupt", summary="raises an interrupt", approximation="exact")),
        (FixedApprox, dict(name="toy-fixed", summary="no budget option", approximation="softmax + 1 %")),
    ]
    import contextlib

    with contextlib.ExitStack() as stack:
        for cls, fields in regs:
            stack.enter_context(attnkit.registered(cls, family="test", **fields))
        yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Tokenizer caches go to a per-test directory, never to ~/.cache."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def cli(capsys):
    """Run ``attnkit ARGS...`` in-process; returns (exit code, stdout, stderr)."""
    from attnkit.cli import main

    def run(*argv: str):
        code = main(list(argv))
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    return run


@pytest.fixture
def corpus_file(tmp_path):
    """A small text corpus (a few hundred lines of varied words)."""
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
             "tau upsilon phi chi psi omega def class return import for while if else").split()
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(600)]
    p = tmp_path / "corpus.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


@pytest.fixture
def interrupting(monkeypatch):
    """Configure ``toy-interrupt``: ``interrupting(kind, when)``; reset after the test."""
    monkeypatch.setattr(Interrupting, "calls", 0)

    def configure(kind: str, when):
        monkeypatch.setattr(Interrupting, "kind", kind)
        monkeypatch.setattr(Interrupting, "when", staticmethod(when))
        return Interrupting

    return configure


@pytest.fixture
def tiny_demo(monkeypatch):
    """The demo's quick presets shrunk to toy sizes (bench L = 32, 64; mqar L = 16; error L = 16)."""
    from attnkit_lab import presets

    monkeypatch.setattr(presets, "bench_presets", lambda: {"quick": dict(
        lengths=[32, 64], batch=1, heads=1, head_dim=8, repeats=1, warmup=1, time_limit=10.0)})
    monkeypatch.setattr(presets, "error_presets", lambda: {"quick": dict(
        lengths=[16], budgets=[4], budget_length=16, temperatures=[1.0], trials=1, batch=1, heads=1, head_dim=8,
        weights_max_length=16)})
    monkeypatch.setitem(presets.TRAIN_PRESETS, "mqar", {"quick": (
        dict(seq_len=16, vocab=16, num_kv_pairs=2),
        dict(steps=2, batch_size=2, eval_every=1, eval_batches=1, dim=8, depth=1, heads=1, token_shift=True))})
