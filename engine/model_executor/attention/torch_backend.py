"""Attention on CPU (or any device) with plain torch ops over the page pool.

- decode rows (one new token): all of them in one call. On CPU a native kernel
  (``cpu_native``) reads each sequence's pages in place; elsewhere, or where it
  cannot be built, the pages are gathered into a padded ``[n, L, kv_heads, dim]``
  block (whole pages, so a handful of large copies) and a float mask hides the
  padding. Either way there is no Python loop over sequences.
- prefill rows (several new tokens): one call per sequence; without a cached
  prefix the new K/V are used directly. In bf16 on a CPU with AVX-512 BF16 the
  native flash kernel (``cpu_prefill_attn.c``) reads a prefix's K/V in place
  from its slots and writes straight into the output rows, ~4x faster than
  PyTorch's CPU flash attention at 512 tokens on Zen 4 (a draft tree's rows take
  it one branch segment at a time: ``_tree_metas``); otherwise the slots are
  gathered and ``scaled_dot_product_attention`` runs causal, or with an
  explicit mask that aligns the causal diagonal at the prefix length. Where the
  CPU has AMX-BF16, PyTorch's flash attention multiplies on AMX and the native
  kernel does not: there it was 1.7-3x faster (Emerald Rapids, 2 threads, the
  default model's heads, 512 and 2048 new tokens, prefixes of 0-1536 tokens
  gathered), so SDPA runs (``native_prefill``).
- decode steps replayed from graphs (``begin_graph_forward``): the same decode
  path over the graph runner's static page table; the torch path then reads
  every page of its full width, masked past each length (a graph fixes the
  shape), which costs a long context's reads at every step: FlashInfer's
  backend reads only each sequence's pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend
from pdserve.kernels.cpu_native import cpu_flags, native_kernels
from pdserve.kernels.kv_ops import gather_pages, gather_slots, slots_of, store_kv

# With few KV heads, one wide bmm against all heads (wasting num_kv_heads x flops on
# cross-group products) beats transposing the gathered K/V into a per-head layout.
_WIDE_MAX_KV_HEADS = 4


@dataclass
class _DecodeMeta:
    rows: torch.Tensor | None  # [n] token rows of decode sequences; None: every row
    pages: torch.Tensor  # [n, P] pages of each sequence (int32 contiguous for the native kernel)
    seq_lens: torch.Tensor  # [n] int32
    mask: torch.Tensor | None  # torch path: [n, 1, P * page_size] float32, 0 where a key exists, else -inf


@dataclass
class _PrefillMeta:
    start: int  # first token row
    end: int
    slots: torch.Tensor | None  # [seq_len] slots to gather; None: no cached prefix, use new K/V
    mask: torch.Tensor | None  # [extend, seq_len] bool, True = attend
    tree: bool = False  # a draft tree's rows: the mask is not causal, so SDPA over the gathered slots


def tree_mask(prefix: int, parents: list[int], device=None) -> torch.Tensor:
    """A draft tree's visibility, [1 + n, prefix + 1 + n] bool: row 0 (the fed token) and row
    ``1 + j`` (node j) see the prefix, the fed token, and their own ancestors and themselves."""
    n = len(parents)
    rows = [[True] + [False] * n]
    for j, p in enumerate(parents):
        row = list(rows[p + 1])
        row[1 + j] = True
        rows.append(row)
    new = torch.tensor(rows, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(1 + n, prefix, dtype=torch.bool, device=device), new], dim=1)


class TorchAttentionBackend(AttentionBackend):
    # draft trees (ForwardBatch.tree_parents) run as masked prefill rows
    supports_tree_mask = True

    def __init__(self, page_pool: PagePool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 use_native: bool = True):
        super().__init__(page_pool, num_heads, num_kv_heads, head_dim, scale)
        native = native_kernels() if use_native and page_pool.device.type == "cpu" else None
        if native is not None and not native.supports(page_pool.dtype, num_heads // num_kv_heads, head_dim):
            native = None
        self.native = native
        # the native prefill kernel, except where AMX carries PyTorch's flash attention
        self.native_prefill = (native is not None and native.supports_prefill(page_pool.dtype, head_dim)
                               and "amx_bf16" not in cpu_flags())

    def begin_forward(self, batch: ForwardBatch) -> None:
        self.loc = batch.out_cache_loc
        device = batch.input_ids.device
        page_size = self.page_pool.page_size
        decode_seqs, decode_rows, self.prefills = [], [], []
        start = 0
        for i, (ext, seq) in enumerate(zip(batch.extend_lens, batch.seq_lens)):
            if ext == 1:
                decode_seqs.append(i)
                decode_rows.append(start)
            elif ext > 1 and batch.tree_parents is not None and batch.tree_parents[i] is not None:
                self.prefills.extend(self._tree_metas(batch, i, start, page_size, device))
            elif ext > 1:
                prefix = seq - ext
                slots = mask = None
                if prefix > 0:
                    slots = slots_of(batch.page_table[i], seq, page_size)
                    if not self.native_prefill:  # the native kernel aligns the diagonal itself
                        # query j sits at position prefix + j and sees keys 0..prefix + j
                        q_pos = torch.arange(prefix, seq, device=device)[:, None]
                        mask = torch.arange(seq, device=device)[None, :] <= q_pos
                self.prefills.append(_PrefillMeta(start, start + ext, slots, mask))
            start += ext
        self.decode = None
        if decode_seqs:
            all_rows = len(decode_seqs) == batch.batch_size
            seq_lens = [batch.seq_lens[i] for i in decode_seqs]
            num_pages = -(-max(seq_lens) // page_size)
            pages = batch.page_table if all_rows else batch.page_table[decode_seqs]
            pages = pages[:, :num_pages]
            lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            rows = None if all_rows else torch.tensor(decode_rows, device=device)
            if self.native is not None:
                self.decode = _DecodeMeta(rows, pages.to(torch.int32).contiguous(), lens, None)
            else:
                key_pos = torch.arange(num_pages * page_size, device=device)
                mask = torch.zeros(len(seq_lens), 1, key_pos.numel(), dtype=torch.float32, device=device)
                mask.masked_fill_(key_pos[None, None, :] >= lens[:, None, None], float("-inf"))
                self.decode = _DecodeMeta(rows, pages.to(torch.int64), lens, mask)

    def _tree_metas(self, batch: ForwardBatch, i: int, start: int, page_size: int, device) -> list[_PrefillMeta]:
        """A draft tree's rows (``ForwardBatch.tree_parents``). Through SDPA: one masked call. Through
        the native kernel (which takes no mask, only key rows with a causal diagonal): one call per
        branch segment, a run of nodes each the child of the one before, contiguous in the rows; its
        keys are the prefix, the fed token, the segment head's ancestors and the segment itself, so
        the diagonal is exactly each node's ancestors. A 2-branch tree costs 2 calls, not a gather."""
        parents = batch.tree_parents[i]
        seq, ext = batch.seq_lens[i], batch.extend_lens[i]
        prefix = seq - ext
        slots = slots_of(batch.page_table[i], seq, page_size)
        if not self.native_prefill:
            return [_PrefillMeta(start, start + ext, slots, tree_mask(prefix, parents, device), tree=True)]
        metas = []
        head = 0  # the segment's first node; the first segment also holds the fed token's row
        for j in range(1, len(parents) + 1):
            if j < len(parents) and parents[j] == j - 1:
                continue
            ancestors, node = [], parents[head]
            while node >= 0:
                ancestors.append(node)
                node = parents[node]
            keys = list(range(prefix + 1)) + [prefix + 1 + a for a in reversed(ancestors)]
            keys += [prefix + 1 + n for n in range(head, j)]
            first_row = 0 if head == 0 else 1 + head
            idx = torch.tensor(keys, device=slots.device)
            metas.append(_PrefillMeta(start + first_row, start + 1 + j, slots[idx], None))
            head = j
        return metas

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        # the native kernel reads the page table and lengths as they are; the torch path masks
        # every key of the static table's width (a graph fixes it) past each sequence's length
        if self.native is None:
            width = max_pages * self.page_pool.page_size
            device = self.page_pool.device
            self._graph_mask = torch.zeros(max_bs, 1, width, dtype=torch.float32, device=device)
            self._graph_key_pos = torch.arange(width, device=device)

    def begin_graph_forward(self, bs: int, page_table: torch.Tensor, seq_lens: torch.Tensor,
                            out_cache_loc: torch.Tensor, host_seq_lens: list[int]) -> None:
        self.loc = out_cache_loc
        self.prefills = []
        mask = None
        if self.native is None:
            mask = self._graph_mask[:bs]
            mask.zero_()
            mask.masked_fill_(self._graph_key_pos[None, None, :] >= seq_lens[:, None, None], float("-inf"))
        self.decode = _DecodeMeta(None, page_table, seq_lens, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        k_cache, v_cache = self.page_pool.k[layer], self.page_pool.v[layer]
        if self.native is not None:
            self.native.store_kv(k_cache, v_cache, self.loc, k, v)
        else:
            store_kv(k_cache, v_cache, self.loc, k, v)
        num_tokens = q.shape[0]
        dec = self.decode
        if dec is not None and dec.rows is None:
            return self._decode(q, k_cache, v_cache, dec)
        out = q.new_empty(num_tokens, self.num_heads * self.head_dim)
        if dec is not None:
            out[dec.rows] = self._decode(q[dec.rows], k_cache, v_cache, dec)
        for p in self.prefills:
            if self.native_prefill and not p.tree:
                if p.slots is None:  # no prefix: the new K/V as they are
                    keys, values = k[p.start : p.end], v[p.start : p.end]
                else:  # with one: every key read in place from its slot in the pool
                    keys, values = self.page_pool.k_slots(layer), self.page_pool.v_slots(layer)
                self.native.prefill_attention(q[p.start : p.end], keys, values, out[p.start : p.end], self.scale,
                                              key_rows=p.slots)
                continue
            out[p.start : p.end] = self._prefill(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end],
                                                 k_cache, v_cache, p)
        return out

    def native_decode_pages(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        dec = self.decode
        if self.native is None or dec is None or dec.rows is not None:
            return None
        return dec.pages, dec.seq_lens

    def _prefill(self, q, k, v, k_cache, v_cache, meta: _PrefillMeta) -> torch.Tensor:
        # q: [n, H, D]; k, v: [n, KVH, D] -> [n, H * D]
        n = q.shape[0]
        if meta.slots is not None:
            k = gather_slots(k_cache, meta.slots)  # [seq_len, KVH, D]
            v = gather_slots(v_cache, meta.slots)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=meta.mask, is_causal=meta.mask is None, scale=self.scale, enable_gqa=True,
        )  # [1, H, n, D]
        return o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    def _decode(self, q, k_cache, v_cache, meta: _DecodeMeta) -> torch.Tensor:
        # q: [n, H, D] -> [n, H * D]
        if self.native is not None:
            return self.native.decode_attention(q, k_cache, v_cache, meta.pages, meta.seq_lens, self.scale)
        n, num_heads, dim = q.shape
        kvh = self.num_kv_heads
        group = num_heads // kvh
        k = gather_pages(k_cache, meta.pages)  # [n, L, KVH, D]
        v = gather_pages(v_cache, meta.pages)
        seq = k.shape[1]
        wide = kvh <= _WIDE_MAX_KV_HEADS
        if wide:
            s = torch.bmm(k.view(n, seq * kvh, dim), q.transpose(1, 2))  # [n, L * KVH, H]
            # keep only products of a query head with its own KV head
            s = s.view(n, seq, kvh, kvh, group).diagonal(dim1=2, dim2=3)  # [n, L, G, KVH]
            s = s.permute(0, 3, 2, 1).reshape(n, num_heads, seq)  # [n, H, L]
        else:
            s = torch.matmul(q.reshape(n, kvh, group, dim), k.permute(0, 2, 3, 1)).view(n, num_heads, seq)
        p = torch.softmax(s.float() * self.scale + meta.mask, dim=-1).to(q.dtype)  # [n, H, L]
        if wide:
            o = torch.bmm(p, v.view(n, seq, kvh * dim))  # [n, H, KVH * D]
            o = o.view(n, kvh, group, kvh, dim).diagonal(dim1=1, dim2=3)  # [n, G, D, KVH]
            return o.permute(0, 3, 1, 2).reshape(n, num_heads * dim)
        o = torch.matmul(p.view(n, kvh, group, seq), v.transpose(1, 2))  # [n, KVH, G, D]
        return o.reshape(n, num_heads * dim)
