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

Multi-head latent attention (a latent pool) plans nothing here: its layers store their own latents
and run their absorbed decode through ``FlashInferMLADecode`` (FlashInfer's
``BatchMLAPagedAttentionWrapper``), which ``MLAStep`` plans once per step from its decode rows
(``layers/mla_attention.py``; the plan's arrays come from ``mla_plan.py``).

Not exercised by this repository's CPU-only CI; written against FlashInfer's
documented ``plan``/``run`` API (0.2 and later).
"""

from __future__ import annotations

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import LATENT, PagePool
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend
from pdserve.engine.model_executor.attention.mla_plan import MLADecodePlan, split_latent
from pdserve.kernels.kv_ops import store_kv

_WORKSPACE_BYTES = 256 * 1024 * 1024
_MLA_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended size for its MLA split-KV partials


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
        # a latent pool's layers attend through FlashInferMLADecode, planned by their MLAStep
        self._latent = page_pool.kind == LATENT

    def begin_forward(self, batch: ForwardBatch) -> None:
        self.loc = batch.out_cache_loc
        if self._latent:
            return
        # CSR page lists, built on the host (plan wants host indptrs) then copied once
        kv_indptr, indices, last_len = self._csr(batch.page_table.cpu(), batch.seq_lens)
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
        self.loc = out_cache_loc
        if self._latent:
            return
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


class FlashInferMLADecode:
    """One step's absorbed MLA decode through FlashInfer's ``BatchMLAPagedAttentionWrapper``:
    planned once from the step's decode rows, then called by every layer over its own latent
    pages, with ``mla_decode_torch``'s contract (``kernels/mla_decode.py``).

    The step owns its wrapper and workspace: torch's caching allocator hands the previous step's
    blocks back, so after the first step a plan allocates no new device memory. The wrapper's
    ``backend`` choice ("auto": FA3 on Hopper, FA2 elsewhere) needs FlashInfer 0.2.2 or later."""

    def __init__(self, plan: MLADecodePlan, num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int,
                 scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device):
        import flashinfer.mla  # noqa: PLC0415  (optional dependency, imported only on the CUDA path)

        self.kv_lora_rank = kv_lora_rank
        self.num_rows = int(plan.kv_len_arr.numel())
        workspace = torch.empty(_MLA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        # causal is moot for one query per request: it sees its kv_len tokens either way
        self._wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices.to(device), plan.kv_len_arr, num_heads,
                           kv_lora_rank, rope_dim, page_size, False, scale, q_dtype, kv_dtype)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q [n, H, kv_lora_rank + rope_dim] (the planned rows, in order); cache the layer's latent
        pool [1, num_pages, page_size, width] -> [n, H, kv_lora_rank]."""
        if q.shape[0] != self.num_rows:
            raise ValueError(f"the step's MLA decode was planned for {self.num_rows} rows, got {q.shape[0]}")
        r = self.kv_lora_rank
        ckv, kpe = split_latent(cache, r)
        # q_nope / q_pe as views: the kernel reads a row and a head through their strides
        return self._wrapper.run(q[..., :r], q[..., r:], ckv, kpe)
