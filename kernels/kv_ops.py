"""KV store and gather over the page pool's per-layer tensors.

A pool tensor is head-major, ``[num_kv_heads, num_pages, page_size, head_dim]``
(``engine/mem_cache/page_pool.py`` says why); a slot is ``page * page_size + offset``
into each head's flat ``[num_slots, dim]`` plane.
"""

from __future__ import annotations

import torch


def _planes(cache: torch.Tensor) -> torch.Tensor:
    """[heads, num_slots, dim] view of a pool tensor."""
    return cache.view(cache.shape[0], -1, cache.shape[3])


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Write new tokens' K/V into their slots; ``v_cache`` and ``v`` None for a latent pool
    (one vector per token, stored as K).

    k_cache, v_cache: [kv_heads, num_pages, page_size, head_dim]; loc: [T] int64 slots;
    k, v: [T, kv_heads, head_dim] (or [T, kv_heads * head_dim]).
    """
    heads, dim = k_cache.shape[0], k_cache.shape[3]
    _planes(k_cache).index_copy_(1, loc, k.view(-1, heads, dim).transpose(0, 1))
    if v_cache is None:
        return
    _planes(v_cache).index_copy_(1, loc, v.view(-1, heads, dim).transpose(0, 1))


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole pages out: page_ids [bs, P] -> [bs, P * page_size, kv_heads, head_dim].

    A head's page is a contiguous run of ``page_size * dim`` elements, so this is a few
    large copies rather than one per token.
    """
    bs, num = page_ids.shape
    heads, _, page_size, dim = cache.shape
    picked = cache.index_select(1, page_ids.reshape(-1))  # [heads, bs * P, page_size, dim]
    return picked.view(heads, bs, num * page_size, dim).permute(1, 2, 0, 3).contiguous()


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy single tokens out: slots [N] -> [N, kv_heads, head_dim]."""
    return _planes(cache).index_select(1, slots).transpose(0, 1)


def slots_of(page_table_row: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """The first ``num_tokens`` slots of a sequence from its pages: [P] -> [num_tokens] int64."""
    pages = page_table_row[: -(-num_tokens // page_size)].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets).reshape(-1)[:num_tokens]
