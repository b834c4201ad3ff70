"""The attention backend interface and its registry.

A backend does two things per layer: write the step's new K/V into the page
pool, and attend each new token over its sequence's cached tokens. Per-step
metadata (gather indices, masks) is built once in ``begin_forward`` and reused
by all layers, which keeps per-layer Python work small.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from pdserve.engine.model_executor.forward_batch import ForwardBatch
from pdserve.engine.sched.page_pool import PagePool


class AttentionBackend(ABC):
    def __init__(self, page_pool: PagePool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.page_pool = page_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def begin_forward(self, batch: ForwardBatch) -> None:
        """Prepare the step's metadata from ``batch`` (tensors already on the pool's device)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Store ``k``/``v`` at the step's ``out_cache_loc`` in ``layer``'s pages, then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (views may be strided).
        Returns [num_tokens, num_heads * head_dim], causal over each sequence's prefix and new tokens.
        """


# name -> "module:Class"; a backend's module is imported only when it is chosen
_REGISTRY: dict[str, str] = {
    "torch": "pdserve.kernels.torch_backend:TorchAttentionBackend",
    "flashinfer": "pdserve.kernels.flashinfer_backend:FlashInferAttentionBackend",
}


def attention_backend_names() -> list[str]:
    """The choices of ``--attention-backend``."""
    return list(_REGISTRY)


def create_attention_backend(name: str, page_pool: PagePool, num_heads: int, num_kv_heads: int,
                             head_dim: int, scale: float) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {list(_REGISTRY)}, got {name!r}")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(page_pool, num_heads, num_kv_heads, head_dim, scale)
