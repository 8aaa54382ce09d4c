"""The sizes behind ``--preset quick|paper`` for ``bench``, ``error``, ``train`` and ``demo``.

Shared by :mod:`attnkit_lab.cli` (options left unset take the preset's value)
and :mod:`attnkit_lab.demo` (which runs the quick presets, shortened).
"""

from __future__ import annotations

from typing import Any

PRESETS = ("quick", "paper")


def bench_presets() -> dict[str, dict[str, Any]]:
    return {
        "quick": dict(lengths=[256, 512, 1024, 2048, 4096, 8192], batch=1, heads=4, head_dim=64, repeats=5,
                      warmup=1, time_limit=10.0),
        # a fuller sweep for a real machine: 8 heads of 64 (d_model 512), up to 32K tokens
        "paper": dict(lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768], batch=4, heads=8, head_dim=64,
                      repeats=20, warmup=3, time_limit=60.0),
    }


def error_presets() -> dict[str, dict[str, Any]]:
    return {
        # T = 8: small-norm q/k, where random features estimate softmax well; T = 0.5: sharp attention
        "quick": dict(lengths=[256, 1024, 4096], budgets=[16, 64, 256], budget_length=1024,
                      temperatures=[8.0, 2.0, 0.5], trials=3, batch=1, heads=2, head_dim=64,
                      weights_max_length=1024),
        # Performer's approximation study (Choromanski et al., 2021) uses feature counts up to 2·D log D
        "paper": dict(lengths=[512, 1024, 2048, 4096, 8192, 16384], budgets=[16, 32, 64, 128, 256, 512, 1024],
                      budget_length=4096, temperatures=[16.0, 8.0, 4.0, 2.0, 1.0, 0.5], trials=10, batch=1, heads=8,
                      head_dim=64, weights_max_length=2048),
    }


# Per task: (task options, training settings) for each preset.
TRAIN_PRESETS: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    "mqar": {
        # 16 pairs in 64 tokens: exact attention solves it in ~150 steps; elu linear attention
        # (32 features per head) does not, DPFP features (64, 128) close the gap
        "quick": (dict(seq_len=64, vocab=128, num_kv_pairs=16),
                  dict(steps=300, batch_size=64, lr=3e-3, warmup=30, eval_every=25, eval_batches=4,
                       dim=64, depth=2, heads=2, token_shift=True)),
        # Zoology (Arora et al., 2023), Figure 2: V=8192, (L, N) = (256, 16), d_model 128, 2 layers,
        # 1 head, dropout 0.1, batch 256, 100k examples x 64 epochs = 25k steps, 3k test examples
        "paper": (dict(seq_len=256, vocab=8192, num_kv_pairs=16),
                  dict(steps=25_000, batch_size=256, lr=1e-3, warmup=1000, eval_every=1000, eval_batches=12,
                       dim=128, depth=2, heads=1, dropout=0.1)),
    },
    "listops": {
        "quick": (dict(max_depth=6, max_args=5, min_length=16, max_length=128),
                  dict(steps=400, batch_size=32, lr=1e-3, warmup=40, eval_every=50, eval_batches=8,
                       dim=64, depth=2, heads=2)),
        # LRA (Tay et al., 2021): depth 10, 10 args, lengths 500-2000; 6 layers, d 512, 8 heads, MLP 2048,
        # batch 32, 5000 steps, warm-up 1000, weight decay 0.1
        "paper": (dict(max_depth=10, max_args=10, min_length=500, max_length=2000),
                  dict(steps=5000, batch_size=32, lr=1e-3, warmup=1000, eval_every=250, eval_batches=63,
                       dim=512, depth=6, heads=8, mlp_ratio=4.0)),
    },
    "copy": {
        "quick": (dict(seq_len=64, vocab=16),
                  dict(steps=400, batch_size=32, lr=3e-3, warmup=40, eval_every=50, eval_batches=4,
                       dim=64, depth=2, heads=2, token_shift=True)),
        # Reformer (Kitaev et al., 2020) §5: 0w0w with |w| = 511 (L = 1024), symbols 1..127,
        # a 1-layer model with d_model 256 and 4 heads, 150k steps
        "paper": (dict(seq_len=1024, vocab=128),
                  dict(steps=150_000, batch_size=16, lr=1e-3, warmup=1000, eval_every=5000, eval_batches=8,
                       dim=256, depth=1, heads=4)),
    },
    "lm": {
        "quick": (dict(seq_len=128, vocab=1024, corpus_chars=2_000_000),
                  dict(steps=200, batch_size=8, lr=3e-3, warmup=20, eval_every=25, eval_batches=8,
                       dim=128, depth=2, heads=4)),
        # no published setup exists for this corpus: a GPT-style small model on the whole stdlib
        "paper": (dict(seq_len=512, vocab=8192, corpus_chars=100_000_000),
                  dict(steps=20_000, batch_size=32, lr=6e-4, warmup=1000, eval_every=1000, eval_batches=32,
                       dim=512, depth=6, heads=8, dropout=0.1)),
    },
}


# The demo's default attentions: the first DEMO_MAX of these that are installed, then any others.
DEMO_PREFERENCE = ("softmax", "linear", "performer", "nystrom", "linformer", "sliding-window", "local", "rfa")
DEMO_MAX = 3
