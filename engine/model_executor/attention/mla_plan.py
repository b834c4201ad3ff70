"""What FlashInfer's MLA decode (``BatchMLAPagedAttentionWrapper``) reads, built from a step's
decode rows: pure torch, no flashinfer import, so CPU tests check it.

A decode row is one query over its sequence's first ``seq_len`` tokens, whose pages are a row of
the page table (padded past the last used page). FlashInfer takes the same facts in CSR form:

- ``qo_indptr``: one query per request, ``[0, 1, ..., n]``;
- ``kv_indptr`` / ``kv_indices``: request i's pages are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``,
  only the ``ceil(seq_len / page_size)`` pages it uses;
- ``kv_len_arr``: its tokens, which also says how much of the last page counts.

The latent pool keeps one ``[c, k_pe]`` vector per token per layer (``[1, num_pages, page_size,
kv_lora_rank + rope_dim]``); FlashInfer wants the compressed kv and the rope key as two paged
tensors, ``ckv [num_pages, page_size, kv_lora_rank]`` and ``kpe [num_pages, page_size, rope_dim]``.
Both are views of the pool (``split_latent``): FlashInfer reads a page and a token through the
tensors' first two strides, so no copy is made and a layer's store is what the next decode reads.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# (kv_lora_rank, rope_dim) of the MLA FlashInfer builds and tests: DeepSeek-V2, V2-Lite and V3's
FLASHINFER_MLA_DIMS = (512, 64)
FLASHINFER_MLA_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MLADecodePlan:
    """``BatchMLAPagedAttentionWrapper.plan``'s arrays for n decode rows, int32. The indptrs and
    lengths are on the host (the plan schedules from them there); the page ids are on the page
    table's device (the kernel reads them)."""

    qo_indptr: torch.Tensor  # [n + 1] host
    kv_indptr: torch.Tensor  # [n + 1] host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] on the page table's device
    kv_len_arr: torch.Tensor  # [n] host


def mla_decode_plan(page_table: torch.Tensor, seq_lens: Sequence[int], page_size: int) -> MLADecodePlan:
    """The plan of decode rows whose pages are ``page_table`` [n, P] (row i's first pages in
    order, padded) and whose lengths are ``seq_lens`` (n host ints, each >= 1). The used pages are
    picked on the table's device with one index built on the host, so a CUDA table is never read
    back to the host."""
    n = len(seq_lens)
    if page_table.dim() != 2 or page_table.shape[0] != n:
        raise ValueError(f"page_table must be [{n}, pages], one row per length, got {tuple(page_table.shape)}")
    if n and min(seq_lens) < 1:
        raise ValueError(f"every decode row attends at least its own token, got lengths {list(seq_lens)}")
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    num_pages = (lens + page_size - 1) // page_size  # [n]
    if n and int(num_pages.max()) > page_table.shape[1]:
        raise ValueError(f"a length of {max(seq_lens)} tokens needs more than the table's "
                         f"{page_table.shape[1]} pages of {page_size}")
    kv_indptr = torch.zeros(n + 1, dtype=torch.int32)
    kv_indptr[1:] = num_pages.cumsum(0)
    # (row, column) of every used page, row-major: the CSR order
    rows = torch.repeat_interleave(torch.arange(n), num_pages.long())
    cols = torch.arange(rows.numel()) - torch.repeat_interleave(kv_indptr[:-1].long(), num_pages.long())
    device = page_table.device
    kv_indices = page_table[rows.to(device), cols.to(device)].to(torch.int32)
    qo_indptr = torch.arange(n + 1, dtype=torch.int32)
    return MLADecodePlan(qo_indptr, kv_indptr, kv_indices, lens)


def split_latent(cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent pool layer [1, num_pages, page_size, kv_lora_rank + rope_dim] as FlashInfer's
    (ckv [num_pages, page_size, kv_lora_rank], kpe [num_pages, page_size, rope_dim]): views that
    share the pool's memory, each with a unit last stride."""
    if cache.dim() != 4 or cache.shape[0] != 1:
        raise ValueError(f"a latent pool layer is [1, pages, page_size, width], got {tuple(cache.shape)}")
    if not 0 < kv_lora_rank < cache.shape[3]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must split the latent width {cache.shape[3]}")
    latent = cache[0]
    return latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]


def flashinfer_mla_fits(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> bool:
    """Whether FlashInfer's MLA kernels take this latent: DeepSeek's widths, in bf16 or fp16."""
    return (kv_lora_rank, rope_dim) == FLASHINFER_MLA_DIMS and dtype in FLASHINFER_MLA_DTYPES


def use_flashinfer_mla(device: torch.device, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> bool:
    """The absorbed decode runs FlashInfer's MLA on a CUDA device where flashinfer is installed and
    the latent fits it; elsewhere the layer's own (native kernel on CPU, torch twin otherwise).
    Looks flashinfer up without importing it, and only for a CUDA device."""
    return (device.type == "cuda" and flashinfer_mla_fits(kv_lora_rank, rope_dim, dtype)
            and importlib.util.find_spec("flashinfer") is not None)
