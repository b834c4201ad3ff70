"""KV store and gather over the page pool's per-layer tensors.

A pool tensor is ``[num_pages, page_size, num_kv_heads, head_dim]``; a slot is
``page * page_size + offset`` into its flat ``[num_slots, heads, dim]`` view.
"""

from __future__ import annotations

import torch


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new tokens' K/V into their slots.

    k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim]; loc: [T] int64 slots;
    k, v: [T, kv_heads, head_dim] (or [T, kv_heads * head_dim]).
    """
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, loc, k.view(-1, heads, dim))
    v_cache.view(-1, heads, dim).index_copy_(0, loc, v.view(-1, heads, dim))


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole pages out: page_ids [bs, P] -> [bs, P * page_size, kv_heads, head_dim].

    Whole pages are contiguous runs of ``page_size * heads * dim`` elements, so this
    is a few large copies rather than one per token.
    """
    bs, num = page_ids.shape
    _, page_size, heads, dim = cache.shape
    return cache.index_select(0, page_ids.reshape(-1)).view(bs, num * page_size, heads, dim)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy single tokens out: slots [N] -> [N, kv_heads, head_dim]."""
    heads, dim = cache.shape[2], cache.shape[3]
    return cache.view(-1, heads, dim).index_select(0, slots)


def slots_of(page_table_row: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """The first ``num_tokens`` slots of a sequence from its pages: [P] -> [num_tokens] int64."""
    pages = page_table_row[: -(-num_tokens // page_size)].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets).reshape(-1)[:num_tokens]
