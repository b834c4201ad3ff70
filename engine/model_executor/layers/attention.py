"""Attention over the paged KV cache: stores this step's K and V and attends, through the
engine's attention backend (torch, native CPU or FlashInfer)."""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend


class Attention:
    """Layer ``layer_id``'s attention of ``num_heads`` query heads over ``num_kv_heads``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] -> [T, H * D]."""
        return attn.forward(q, k, v, self.layer_id)
