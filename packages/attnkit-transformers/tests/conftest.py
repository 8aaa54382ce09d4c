"""Tiny randomly initialised models built from configs: no network, no downloads."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

import attnkit_transformers  # noqa: E402

VOCAB = 97


def llama_config(**extra) -> LlamaConfig:
    """2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention), head_dim 8."""
    return LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2), **extra})


def gpt2_config(**extra) -> GPT2Config:
    """2 layers, 4 heads, learned positions, no dropout (attnkit mechanisms apply none)."""
    return GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                         **extra})


CONFIGS = {"llama": llama_config, "gpt2": gpt2_config}


def make_model(kind: str, impl: str, seed: int = 0, **extra):
    """A float32 model of ``kind`` with ``attn_implementation=impl``, weights from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](**extra), attn_implementation=impl)
    return model.eval()


def twin(kind: str, impl: str, other: str, seed: int = 0, **extra):
    """Two models with the same weights, one per attention implementation."""
    a = make_model(kind, impl, seed, **extra)
    b = make_model(kind, other, seed, **extra)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.fixture(scope="session", autouse=True)
def _registered():
    names = attnkit_transformers.register()
    yield names
