"""Paged KV cache: one K and one V tensor per layer, and the page allocator.

Layout per layer and per K/V: head-major, ``[num_kv_heads, num_pages, page_size, head_dim]``.
The KV of one head over a run of consecutive pages is therefore one contiguous byte range
per layer per K/V, which is what the KV transfer layer writes: when the prefill and decode
sides split the KV heads differently (tensor parallelism of different sizes), a head slice of
a page run is still one descriptor per head, where a token-major page
(``[pages, page_size, heads, dim]``) cuts it into one small descriptor per token, which the
transfer engines move at a few MB/s (measured: ``scripts/bench_kvtransfer.py --cases
mismatched``). It is vLLM's "HND" choice for heterogeneous TP, at the level of the whole
pool. A token's *slot* is ``page * page_size + offset``; ``k_slots`` is the
``[num_slots, heads, dim]`` view (strided over heads) that the store/gather kernels index.

A *latent* pool (``kind="latent"``, multi-head latent attention) holds one vector per token per
layer, shared by all heads: ``num_kv_heads == 1``, ``head_dim`` the latent width
(``kv_lora_rank + qk_rope_head_dim``), K buffers only (``v == []``). Everything that walks K and V
walks ``(*k, *v)``, so it walks the latent buffers alone.

Page 0 is reserved as a scratch page (padding in page tables points at it), so
it is never handed out and never counted as free or used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.mem_cache.free_list import FreeList
from pdserve.engine.quantization_names import UNQUANTIZED


MHA = "mha"  # a K and a V per layer, per KV head
LATENT = "latent"  # one latent vector per token per layer (MLA), K buffers only
KV_KINDS = (MHA, LATENT)


def kv_planes(kind: str) -> int:
    """Buffers per layer of a pool of ``kind``: 2 (K and V) or 1 (the latent)."""
    if kind not in KV_KINDS:
        raise ValueError(f"KV layout kind must be one of {KV_KINDS}, got {kind!r}")
    return 1 if kind == LATENT else 2


class OutOfPagesError(RuntimeError):
    """Raised by ``alloc`` when fewer pages are free than asked for."""


@dataclass(frozen=True)
class KVLayout:
    """What a peer must agree on before KV bytes can be copied between pools."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    # the weights' (quantization_names.QUANTIZATIONS): KV computed by differently quantized weights differs,
    # so a prefill and a decode must agree on it as on the dtype
    quantization: str
    # which model and weights compute the KV (model_executor/model_identity.py); "" when unknown
    model: str = ""
    # MHA (K and V per KV head) or LATENT (one vector per token per layer, K buffers only)
    kind: str = MHA

    @property
    def planes(self) -> int:
        """Buffers per layer: 2 (K, V) or 1 (latent)."""
        return kv_planes(self.kind)

    @property
    def head_page_bytes(self) -> int:
        """Bytes of one head's page of one layer's K (or V): the unit a transfer descriptor counts in."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.page_size * self.head_dim * itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V), all its heads."""
        return self.num_kv_heads * self.head_page_bytes


@dataclass(frozen=True)
class BufferInfo:
    """One registered region: a layer's K or V tensor (head-major: one plane of pages per head)."""

    base_addr: int  # address of head 0's page 0
    nbytes: int  # whole tensor
    page_bytes: int  # one page, all heads
    head_page_bytes: int  # one head's page: the stride between consecutive pages of a head
    plane_bytes: int  # one head's pages: the stride between consecutive heads
    device: str = "cpu"  # where the tensor lives (torch's spelling: "cpu", "cuda:N")


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        quantization: str = UNQUANTIZED,
        kind: str = MHA,
    ):
        planes = kv_planes(kind)
        if kind == LATENT and num_kv_heads != 1:
            raise ValueError(f"a latent KV pool has one vector per token (num_kv_heads 1), got {num_kv_heads}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantization = quantization
        self.kind = kind
        self.model = ""  # the model's identity, set by the runner that computes into this pool
        self.device = torch.device(device)
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        # zeros, not empty: untouched pages must read as zeros in transfer tests
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)] if planes == 2 else []
        # LIFO free list: recently freed pages are reused first (warm in cache)
        self._pages = FreeList(range(num_pages - 1, 0, -1), "page")

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._pages.num_free

    @property
    def num_used(self) -> int:
        return self._pages.num_used

    def used_pages(self) -> frozenset[int]:
        """The pages handed out and not freed (for the owners' integrity checks)."""
        return self._pages.used()

    @property
    def max_total_tokens(self) -> int:
        return self.capacity * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------- allocation
    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        pages = self._pages.take(n)
        if pages is None:
            raise OutOfPagesError(f"asked for {n} pages, {self._pages.num_free} free")
        return pages

    def free(self, pages: list[int]) -> None:
        self._pages.give_back(pages)

    def check_integrity(self) -> None:
        """Prove free + used = capacity and that no page is owned twice."""
        free = self._pages.check_integrity()
        if 0 in free or 0 in self._pages.used():
            raise AssertionError("scratch page 0 was handed out")

    # ------------------------------------------------------- memory occupation
    def release_memory(self) -> int:
        """Give the K/V buffers' memory back to the OS, keeping their addresses (they may be
        registered with a transfer engine); only with no page in use. Returns the bytes released."""
        if self._pages.num_used:
            raise RuntimeError(f"cannot release the KV pool with {self._pages.num_used} pages in use")
        from pdserve.engine.mem_cache.host_memory import discard_pages

        return sum(discard_pages(t) for t in (*self.k, *self.v))

    def resume_memory(self) -> None:
        """Back the buffers with memory again, zeroed as at start (the OS faults pages in here,
        not in the next step)."""
        for t in (*self.k, *self.v):
            t.zero_()

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots ``src`` into slots ``dst`` in every layer (a draft tree's accepted
        path moving to its positions' slots). Every source is read before any destination is written,
        so overlapping moves are safe; under TP each rank moves its own heads alike."""
        if len(src) != len(dst):
            raise ValueError(f"move_slots needs one destination per source, got {len(src)} and {len(dst)}")
        if not src:
            return
        s = torch.tensor(src, dtype=torch.int64, device=self.device)
        d = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for t in (*self.k, *self.v):
            planes = t.view(self.num_kv_heads, -1, self.head_dim)  # [heads, num_slots, dim]
            planes.index_copy_(1, d, planes.index_select(1, s))

    # ------------------------------------------------------------------ views
    def k_slots(self, layer: int) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` view of layer's K (heads strided by a plane)."""
        return self.k[layer].view(self.num_kv_heads, -1, self.head_dim).transpose(0, 1)

    def v_slots(self, layer: int) -> torch.Tensor:
        if not self.v:
            raise ValueError("a latent KV pool has no V buffers")
        return self.v[layer].view(self.num_kv_heads, -1, self.head_dim).transpose(0, 1)

    # ------------------------------------------------- transfer registration
    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            page_size=self.page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            model=self.model,
            kind=self.kind,
        )

    def buffer_infos(self) -> list[BufferInfo]:
        """Regions to register with a transfer engine: all layers' K, then all layers' V (none in a
        latent pool)."""
        lay = self.layout()
        return [
            BufferInfo(t.data_ptr(), t.numel() * t.element_size(), lay.page_bytes, lay.head_page_bytes,
                       lay.head_page_bytes * self.num_pages, str(t.device))
            for t in (*self.k, *self.v)
        ]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        kind: str = MHA) -> int:
        """KV bytes one token takes over all layers: K and V per KV head, or one latent vector."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return kv_planes(kind) * num_layers * num_kv_heads * head_dim * itemsize
