"""Attention restricted to a sliding window: query i sees keys j with ``i - window < j <= i``
(transformers' ``sliding_window_overlay``), Gemma's local layers.

Every key is still stored (the page pool, prefix cache and KV transfer see a sliding layer as
any other), so the window is only which keys a query reads. A step whose sequences are all
within the window is exactly full causal attention and goes through the engine's backend as it
is (no backend knows windows); a step with a longer sequence stores K/V through the backend's
pool and attends in torch (SDPA over each sequence's keys in the window, gathered by slot).
The choice reads the step's lengths on the host, so a CUDA graph cannot capture it (refused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.model_executor.forward_batch import ForwardBatch
from pdserve.kernels.attention_backend import AttentionBackend
from pdserve.kernels.kv_ops import gather_slots, slots_of, store_kv


class SlidingWindowAttention:
    """Layer ``layer_id``'s attention over at most the last ``window`` positions."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, window: int):
        if window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {window}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionBackend,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] -> [T, H * D]."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # a graph would fix the path chosen from the capture's lengths, not the replay's
            raise RuntimeError("sliding-window attention cannot be captured in a CUDA graph: run with "
                               "--disable-cuda-graph")
        if max(batch.seq_lens, default=0) <= self.window:
            return attn.forward(q, k, v, self.layer_id)
        pool = attn.page_pool
        k_cache, v_cache = pool.k[self.layer_id], pool.v[self.layer_id]
        store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        start = 0
        for i, (ext, seq) in enumerate(zip(batch.extend_lens, batch.seq_lens)):
            if ext == 0:
                continue
            first_key = max(0, seq - ext - self.window + 1)  # the first key any of its queries sees
            slots = slots_of(batch.page_table[i], seq, pool.page_size)[first_key:]
            keys, values = gather_slots(k_cache, slots), gather_slots(v_cache, slots)  # [L, KVH, D]
            q_pos = torch.arange(seq - ext, seq, device=q.device)[:, None]  # [ext, 1]
            k_pos = torch.arange(first_key, seq, device=q.device)[None, :]  # [1, L]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)  # [ext, L], True: attend
            o = F.scaled_dot_product_attention(
                q[start : start + ext].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None], attn_mask=mask, scale=attn.scale, enable_gqa=True,
            )  # [1, H, ext, D]
            out[start : start + ext] = o[0].transpose(0, 1).reshape(ext, -1)
            start += ext
        return out
