"""Attention on CUDA with FlashInfer's paged-KV wrappers.

Imported only when ``--attention-backend flashinfer`` is chosen (flashinfer is
in the ``cuda`` extra). The pool's per-layer ``[kv_heads, num_pages, page_size,
dim]`` tensors, transposed to ``[num_pages, kv_heads, page_size, dim]`` (a view,
strided over pages), are FlashInfer's "HND" paged layout, which it reads through
the tensors' strides, so no copy or conversion is needed: a step plans once from
the page table (CSR page lists and last-page lengths) and every layer runs
against the same plan. Decode steps replayed from CUDA graphs
(``engine/model_executor/cuda_graph_runner.py``) run FlashInfer's CUDA-graph
decode wrappers, one per batch-size bucket over shared fixed buffers, planned
before each replay.

Not exercised by this repository's CPU-only CI; written against FlashInfer's
documented ``plan``/``run`` API (0.2 and later).
"""

from __future__ import annotations

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend
from pdserve.kernels.kv_ops import store_kv

_WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, page_pool: PagePool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(page_pool, num_heads, num_kv_heads, head_dim, scale)
        if page_pool.device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs device cuda")
        import flashinfer  # noqa: PLC0415  (optional dependency, imported only when chosen)

        self._flashinfer = flashinfer
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=page_pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND")
        self._graph_decode: dict[int, object] = {}  # batch size -> a CUDA-graph decode wrapper
        self._run = self._decode  # the wrapper this step's layers run

    def begin_forward(self, batch: ForwardBatch) -> None:
        # CSR page lists, built on the host (plan wants host indptrs) then copied once
        kv_indptr, indices, last_len = self._csr(batch.page_table.cpu(), batch.seq_lens)
        self.loc = batch.out_cache_loc
        if batch.is_decode:
            self._run = self._decode
            self._plan_decode(self._decode, kv_indptr, indices, last_len)
        else:
            qo_indptr = torch.tensor([0, *torch.tensor(batch.extend_lens).cumsum(0).tolist()], dtype=torch.int32)
            # causal with more keys than queries aligns queries to the end: the prefix is visible
            self._prefill.plan(qo_indptr, kv_indptr, indices.to(self.page_pool.device), last_len, self.num_heads,
                               self.num_kv_heads, self.head_dim, self.page_pool.page_size, causal=True,
                               **self._dtypes())
            self._run = self._prefill

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        # FlashInfer's CUDA-graph decode wrappers read their plan from buffers of fixed addresses,
        # one wrapper per batch size, all slicing the same buffers (as SGLang's backend does)
        device = self.page_pool.device
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=device)
        self._graph_last_len = torch.zeros(max_bs, dtype=torch.int32, device=device)

    def begin_graph_forward(self, bs: int, page_table: torch.Tensor, seq_lens: torch.Tensor,
                            out_cache_loc: torch.Tensor, host_seq_lens: list[int]) -> None:
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND", use_cuda_graph=True, paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_indices, paged_kv_last_page_len_buffer=self._graph_last_len[:bs],
            )
            self._graph_decode[bs] = wrapper
        # plan copies the CSR lists into the wrapper's buffers, which the captured kernels read
        kv_indptr, indices, last_len = self._csr(page_table.cpu(), host_seq_lens)
        self._plan_decode(wrapper, kv_indptr, indices, last_len)
        self.loc = out_cache_loc
        self._run = wrapper

    def _csr(self, page_table: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr, page indices, last page lengths), int32 on the host, from a host page table."""
        ps = self.page_pool.page_size
        num_pages = [-(-s // ps) for s in seq_lens]
        indices = torch.cat([page_table[i, :n] for i, n in enumerate(num_pages)]).to(torch.int32)
        kv_indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32)
        last_len = torch.tensor([s - (n - 1) * ps for s, n in zip(seq_lens, num_pages)], dtype=torch.int32)
        return kv_indptr, indices, last_len

    def _plan_decode(self, wrapper, kv_indptr: torch.Tensor, indices: torch.Tensor, last_len: torch.Tensor) -> None:
        wrapper.plan(kv_indptr, indices.to(self.page_pool.device), last_len, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.page_pool.page_size, pos_encoding_mode="NONE", **self._dtypes())

    def _dtypes(self) -> dict:
        return dict(q_data_type=self.page_pool.dtype, kv_data_type=self.page_pool.dtype, sm_scale=self.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        k_cache, v_cache = self.page_pool.k[layer], self.page_pool.v[layer]
        store_kv(k_cache, v_cache, self.loc, k, v)
        wrapper = self._run
        out = wrapper.run(q.contiguous(), (k_cache.transpose(0, 1), v_cache.transpose(0, 1)))  # [T, H, D]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
