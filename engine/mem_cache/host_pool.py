"""The host tier (L2) of the hierarchical KV cache: pages of KV in host memory.

The KV pool (L1, ``PagePool``) is what the scheduler admits against; the host
pool is a larger budget of the same pages where the prefix cache keeps pages it
evicts from L1, so that a later match loads them back (one copy) instead of
recomputing them. On CPU both tiers are DRAM and the copy is a memcpy; on CUDA
the host tensor is pinned, so the copies are DMA transfers.

Layout: page-major, ``[num_slots, planes (K, V; the latent alone in a latent pool), num_layers, num_kv_heads, page_size,
head_dim]``: one slot's bytes are one contiguous range, which is what the
storage tier (L3) puts and gets as one object. The KV pool is head-major per
layer (``[heads, pages, page_size, dim]``), so a copy between them is one gather
or scatter per layer and per K/V.

Slot 0 is not reserved (unlike the KV pool's scratch page): nothing pads into
the host tier.
"""

from __future__ import annotations

import torch

from pdserve.engine.mem_cache.free_list import FreeList
from pdserve.engine.mem_cache.page_pool import PagePool, kv_planes


def _buffers(pool: PagePool, layer: int) -> tuple[torch.Tensor, ...]:
    """Layer's K and V, or its latent alone."""
    return (pool.k[layer], pool.v[layer]) if pool.v else (pool.k[layer],)


class HostKVPool:
    def __init__(self, pool: PagePool, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the host tier needs >= 1 page, got {num_slots}")
        self.num_slots = num_slots
        self.page_size = pool.page_size
        self.num_layers = pool.num_layers
        self.dtype = pool.dtype
        pin = pool.device.type == "cuda"
        self.planes = kv_planes(pool.kind)
        # data: [num_slots, planes, num_layers, num_kv_heads, page_size, head_dim]
        self.data = torch.zeros(
            (num_slots, self.planes, pool.num_layers, pool.num_kv_heads, pool.page_size, pool.head_dim),
            dtype=pool.dtype, pin_memory=pin,
        )
        self._slots = FreeList(range(num_slots - 1, -1, -1), "host slot")

    @staticmethod
    def slots_for(pool: PagePool, ratio: float, size_gb: float) -> int:
        """Pages of the host tier: ``size_gb`` GiB if > 0 (SGLang's ``--hicache-size``), else
        ``ratio`` times the KV pool (``--hicache-ratio``)."""
        if size_gb > 0:
            page_bytes = kv_planes(pool.kind) * pool.num_layers * pool.layout().page_bytes
            return int(size_gb * 2**30) // page_bytes
        return int(pool.capacity * ratio)

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    @property
    def slot_bytes(self) -> int:
        """Bytes of one page of every layer's K and V, or latent (one slot, one storage object)."""
        return self.data[0].numel() * self.data.element_size()

    def used_slots(self) -> frozenset[int]:
        return self._slots.used()

    # ------------------------------------------------------------- allocation
    def alloc(self, n: int) -> list[int] | None:
        """``n`` slots, or None if fewer are free (the caller evicts and retries, or skips)."""
        return self._slots.take(n)

    def free(self, slots: list[int]) -> None:
        self._slots.give_back(slots)

    def check_integrity(self) -> None:
        self._slots.check_integrity()

    # ------------------------------------------------------------------ copies
    def write(self, pool: PagePool, pages: list[int], slots: list[int]) -> None:
        """Copy KV pool ``pages`` into host ``slots`` (L1 -> L2)."""
        self._copy(pool, pages, slots, to_host=True)

    def read(self, pool: PagePool, slots: list[int], pages: list[int]) -> None:
        """Copy host ``slots`` into KV pool ``pages`` (L2 -> L1)."""
        self._copy(pool, pages, slots, to_host=False)

    def _copy(self, pool: PagePool, pages: list[int], slots: list[int], to_host: bool) -> None:
        """Every layer's K and V of ``pages`` to ``slots`` (``to_host``) or back; a copy to the
        host is complete on return (the pool's pages may be reused at once)."""
        if not pages:
            return
        p = torch.tensor(pages, device=pool.device)
        s = torch.tensor(slots)
        for layer in range(self.num_layers):
            for kv, buf in enumerate(_buffers(pool, layer)):
                # buf[:, p]: [heads, n, page_size, dim]; data[s, kv, layer]: [n, heads, page_size, dim]
                if to_host:
                    self.data[s, kv, layer] = buf[:, p].transpose(0, 1).to("cpu", non_blocking=True)
                else:
                    buf[:, p] = self.data[s, kv, layer].to(pool.device, non_blocking=True).transpose(0, 1)
        if to_host and pool.device.type == "cuda":
            torch.cuda.current_stream(pool.device).synchronize()

    # ------------------------------------------------------------ storage view
    def slot_bytes_view(self, slot: int) -> torch.Tensor:
        """One slot as a flat uint8 tensor (a view: writing it fills the slot)."""
        return self.data[slot].view(-1).view(torch.uint8)
