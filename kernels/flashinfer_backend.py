"""Attention on CUDA with FlashInfer's paged-KV wrappers.

Imported only when ``--attention-backend flashinfer`` is chosen (flashinfer is
in the ``cuda`` extra). The pool's per-layer ``[kv_heads, num_pages, page_size,
dim]`` tensors, transposed to ``[num_pages, kv_heads, page_size, dim]`` (a view,
strided over pages), are FlashInfer's "HND" paged layout, which it reads through
the tensors' strides, so no copy or conversion is needed: a step plans once from
the page table (CSR page lists and last-page lengths) and every layer runs
against the same plan.

Not exercised by this repository's CPU-only CI; written against FlashInfer's
documented ``plan``/``run`` API (0.2 and later).
"""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.forward_batch import ForwardBatch
from pdserve.engine.sched.page_pool import PagePool
from pdserve.kernels.attention_backend import AttentionBackend
from pdserve.kernels.kv_ops import store_kv

_WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, page_pool: PagePool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(page_pool, num_heads, num_kv_heads, head_dim, scale)
        if page_pool.device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs device cuda")
        import flashinfer  # noqa: PLC0415  (optional dependency, imported only when chosen)

        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=page_pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")

    def begin_forward(self, batch: ForwardBatch) -> None:
        ps = self.page_pool.page_size
        device = self.page_pool.device
        num_pages = [-(-s // ps) for s in batch.seq_lens]
        # CSR page lists, built on the host (plan wants host indptrs) then copied once
        page_table = batch.page_table.cpu()
        indices = torch.cat([page_table[i, :n] for i, n in enumerate(num_pages)]).to(torch.int32)
        kv_indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32)
        last_len = torch.tensor([s - (n - 1) * ps for s, n in zip(batch.seq_lens, num_pages)], dtype=torch.int32)
        self.loc = batch.out_cache_loc
        self.is_decode = batch.is_decode
        common = dict(q_data_type=self.page_pool.dtype, kv_data_type=self.page_pool.dtype, sm_scale=self.scale)
        if self.is_decode:
            self._decode.plan(kv_indptr, indices.to(device), last_len, self.num_heads, self.num_kv_heads,
                              self.head_dim, ps, pos_encoding_mode="NONE", **common)
        else:
            qo_indptr = torch.tensor([0, *torch.tensor(batch.extend_lens).cumsum(0).tolist()], dtype=torch.int32)
            # causal with more keys than queries aligns queries to the end: the prefix is visible
            self._prefill.plan(qo_indptr, kv_indptr, indices.to(device), last_len, self.num_heads,
                               self.num_kv_heads, self.head_dim, ps, causal=True, **common)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        k_cache, v_cache = self.page_pool.k[layer], self.page_pool.v[layer]
        store_kv(k_cache, v_cache, self.loc, k, v)
        wrapper = self._decode if self.is_decode else self._prefill
        out = wrapper.run(q.contiguous(), (k_cache.transpose(0, 1), v_cache.transpose(0, 1)))  # [T, H, D]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
