"""Fixtures of the API tests: checkpoint B, a perturbed copy of the default model."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint
from pdserve.engine.text.tokenizer import load_tokenizer

# relative noise on every matrix of B: large enough that greedy outputs differ from A's
NOISE = 0.25


@pytest.fixture(scope="session")
def checkpoint_b(tmp_path_factory) -> str:
    """The default model (A, a GGUF file) with seeded noise on its matrices, saved as a Hugging Face
    directory (safetensors, config.json, tokenizer files): same architecture, other weights."""
    arch, weights, _ = load_model(None)
    gen = torch.Generator().manual_seed(1234)
    for name, w in weights.items():
        if w.dim() == 2:
            w.add_(torch.randn(w.shape, generator=gen) * w.std() * NOISE)
    path = tmp_path_factory.mktemp("checkpoint_b")
    save_hf_checkpoint(arch, weights, str(path))
    load_tokenizer(None).save_pretrained(str(path))
    return str(path)
