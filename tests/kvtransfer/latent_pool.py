"""A latent KV pool as MLA models keep it: one vector of ``kv_lora_rank + qk_rope_head_dim`` values per
token per layer (one "head"), K buffers only, its layout's kind "latent"."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pdserve.engine.mem_cache.page_pool import KVLayout, PagePool


@dataclass(frozen=True)
class LatentLayout(KVLayout):
    kind: str = "latent"


class LatentPool(PagePool):
    def __init__(self, num_pages: int, page_size: int, num_layers: int, latent_dim: int, dtype: torch.dtype):
        super().__init__(num_pages, page_size, num_layers, 1, latent_dim, dtype)
        self.v = []  # the latent vector is the K; the values come out of it (W_UV)

    def layout(self) -> KVLayout:
        return LatentLayout(**{**asdict(super().layout()), "kind": "latent"})
