"""Attention restricted to a sliding window: query i sees keys j with ``i - window < j <= i``
(transformers' ``sliding_window_overlay``), Gemma's local layers.

Every key is still stored (the page pool, prefix cache and KV transfer see a sliding layer as
any other), so the window is only which keys a query reads. A step whose sequences are all
within the window is exactly full causal attention and goes through the engine's backend as it
is (no backend knows windows); a step with a longer sequence stores K/V through the backend's
pool and attends in torch (SDPA over each sequence's keys in the window, gathered by slot).
The choice reads the step's lengths on the host, so a CUDA graph cannot capture it (refused).

What every sliding layer of a step shares (which rows decode, the slots and masks of the
windows) is built once per step by ``SlidingWindowStep.begin_step``, as rotary's tables are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend
from pdserve.kernels.kv_ops import gather_slots, slots_of, store_kv


@dataclass
class _Extend:
    """One sequence of several new tokens: its rows, the key slots its queries read and the mask."""
    start: int
    ext: int
    slots: torch.Tensor  # [L]
    mask: torch.Tensor  # [ext, L], True: attend


class SlidingWindowStep:
    """The window's per-step plan, shared by a model's sliding layers."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {window}")
        self.window = window
        self.windowed = False  # a sequence of this step is longer than the window
        self.decode_rows: torch.Tensor | None = None  # [n] rows of the one-token sequences
        self.decode_slots = self.decode_valid = None  # [n, width] each
        self.extends: list[_Extend] = []

    def begin_step(self, batch: ForwardBatch, page_size: int) -> None:
        self.windowed = max(batch.seq_lens, default=0) > self.window
        self.decode_rows, self.decode_slots, self.decode_valid, self.extends = None, None, None, []
        if not self.windowed:
            return
        device = batch.input_ids.device
        starts = [0]
        for ext in batch.extend_lens:
            starts.append(starts[-1] + ext)
        decode = [i for i, ext in enumerate(batch.extend_lens) if ext == 1]
        if decode:  # all of the step's next tokens in one batched product
            self.decode_rows = torch.tensor([starts[i] for i in decode], device=device)
            seq_lens = torch.tensor([batch.seq_lens[i] for i in decode], device=device)
            width = min(self.window, int(seq_lens.max()))
            pos = seq_lens[:, None] - width + torch.arange(width, device=device)[None, :]  # [n, width]
            self.decode_valid = pos >= 0  # a sequence shorter than the window has fewer keys
            pos = pos.clamp(min=0)
            pages = batch.page_table[decode].long()
            self.decode_slots = pages.gather(1, pos // page_size) * page_size + pos % page_size
        for i, (ext, seq) in enumerate(zip(batch.extend_lens, batch.seq_lens)):
            if ext < 2:
                continue
            first_key = max(0, seq - ext - self.window + 1)  # the first key any of its queries sees
            slots = slots_of(batch.page_table[i], seq, page_size)[first_key:]
            q_pos = torch.arange(seq - ext, seq, device=device)[:, None]  # [ext, 1]
            k_pos = torch.arange(first_key, seq, device=device)[None, :]  # [1, L]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
            self.extends.append(_Extend(starts[i], ext, slots, mask))


class SlidingWindowAttention:
    """Layer ``layer_id``'s attention over at most the last ``step.window`` positions."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, step: SlidingWindowStep):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.step = step

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionBackend,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] -> [T, H * D]; ``step.begin_step(batch, ...)`` already ran."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # a graph would fix the path chosen from the capture's lengths, not the replay's
            raise RuntimeError("sliding-window attention cannot be captured in a CUDA graph: run with "
                               "--disable-cuda-graph")
        plan = self.step
        if not plan.windowed:
            return attn.forward(q, k, v, self.layer_id)
        pool = attn.page_pool
        k_cache, v_cache = pool.k[self.layer_id], pool.v[self.layer_id]
        store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if plan.decode_rows is not None:
            rows = plan.decode_rows
            out[rows] = self._decode(q[rows], k_cache, v_cache, attn.scale)
        for e in plan.extends:
            keys, values = gather_slots(k_cache, e.slots), gather_slots(v_cache, e.slots)  # [L, KVH, D]
            o = F.scaled_dot_product_attention(
                q[e.start : e.start + e.ext].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None], attn_mask=e.mask, scale=attn.scale, enable_gqa=True,
            )  # [1, H, ext, D]
            out[e.start : e.start + e.ext] = o[0].transpose(0, 1).reshape(e.ext, -1)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Each one-token sequence's query over its last ``window`` keys. q [n, H, D] -> [n, H * D]."""
        n, H, D = q.shape
        KVH = self.num_kv_heads
        slots, valid = self.step.decode_slots, self.step.decode_valid
        width = slots.shape[1]
        keys = gather_slots(k_cache, slots.reshape(-1)).view(n, width, KVH, D)
        values = gather_slots(v_cache, slots.reshape(-1)).view(n, width, KVH, D)
        s = torch.einsum("nkgd,nwkd->nkgw", q.view(n, KVH, H // KVH, D), keys)  # [n, KVH, G, width]
        s = (s.float() * scale).masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(q.dtype)
        return torch.einsum("nkgw,nwkd->nkgd", p, values).reshape(n, H * D)
