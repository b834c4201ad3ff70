"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV pool.

Per token the layer caches one vector per layer, shared by every head: the compressed kv
``c = RMSNorm(x W_DKV)`` (``kv_lora_rank`` wide) and the rotated rope key ``k_pe``
(``qk_rope_head_dim``). Two forms of the same attention:

- expanded (prefill): ``kv_b_proj`` decompresses c into each head's ``k_nope`` and ``v``, and
  the keys are ``[k_nope, k_pe]``; SDPA, causal over the prefix and the new tokens.
- absorbed (decode): W_UK is folded into the query (``q_nope W_UK``, latent-wide) and W_UV into
  the output, so the attention reads the latent pages directly: one key of width
  ``kv_lora_rank + rope_dim`` for every head (``kernels/mla_decode.py``: the native CPU kernel,
  its torch twin elsewhere; on CUDA with flashinfer installed, FlashInfer's MLA decode,
  ``attention/flashinfer_backend.py``'s ``FlashInferMLADecode``, planned once per step by
  ``MLAStep``).

The query is low-rank when ``q_lora_rank`` is set (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``), one ``q_proj`` otherwise. Under TP each rank holds its heads' rows of the
q and kv_b projections and its columns of ``o_proj``; the latent projection is replicated, so
every rank caches the same latent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.model_executor.attention.mla_plan import mla_decode_plan, use_flashinfer_mla
from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.engine.model_executor.layers.norm import RMSNorm
from pdserve.engine.model_executor.layers.yarn_rope import LatentRope
from pdserve.engine.model_executor.parallel import HeadShard
from pdserve.kernels.kv_ops import gather_slots, slots_of, store_kv
from pdserve.kernels.mla_decode import mla_decode_fn

if TYPE_CHECKING:
    from pdserve.engine.model_executor.attention.flashinfer_backend import FlashInferMLADecode


@dataclass(frozen=True)
class MLAShape:
    hidden: int
    num_heads: int  # all heads of the model
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The cached vector's width: ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class _Prefill:
    start: int  # first token row
    end: int
    slots: torch.Tensor | None  # [seq_len] the sequence's slots when it has a cached prefix


class MLAStep:
    """One step's attention metadata, built once and read by every layer: decode rows (one new
    token each) attend in the absorbed form, the others in the expanded form.
    ``absorbed_prefill`` sends every row through the absorbed form (the two forms' equality test)."""

    def __init__(self, batch: ForwardBatch, page_size: int, absorbed_prefill: bool = False):
        self.page_size = page_size
        if batch.tree_parents is not None and any(p is not None for p in batch.tree_parents):
            raise ValueError("multi-head latent attention does not take draft trees")
        self.loc = batch.out_cache_loc
        device = batch.input_ids.device
        self.prefills: list[_Prefill] = []
        dec_rows, dec_seqs, dec_lens = [], [], []
        start = 0
        for i, (ext, seq) in enumerate(zip(batch.extend_lens, batch.seq_lens)):
            if ext == 1 or (absorbed_prefill and ext > 0):
                # each new token of a sequence is a query over the keys up to its position
                for j in range(ext):
                    dec_rows.append(start + j)
                    dec_seqs.append(i)
                    dec_lens.append(seq - ext + j + 1)
            elif ext > 1:
                slots = slots_of(batch.page_table[i], seq, page_size) if seq > ext else None
                self.prefills.append(_Prefill(start, start + ext, slots))
            start += ext
        self.all_decode = len(dec_rows) == batch.num_tokens
        self.dec_rows = torch.tensor(dec_rows, dtype=torch.int64, device=device)
        self.dec_lens_host = dec_lens
        self.dec_lens = torch.tensor(dec_lens, dtype=torch.int32, device=device)
        self.dec_pages = None
        if dec_rows:
            width = -(-max(dec_lens) // page_size)
            self.dec_pages = batch.page_table[torch.tensor(dec_seqs, device=device)][:, :width].to(torch.int32)
        self._flashinfer: FlashInferMLADecode | None = None

    def flashinfer_decode(self, num_heads: int, shape: MLAShape, scale: float, q_dtype: torch.dtype,
                          cache: torch.Tensor) -> FlashInferMLADecode:
        """The step's FlashInfer MLA decode of its decode rows, planned when the first layer asks:
        every layer has the same heads, widths, scale and dtypes, so one plan serves them all."""
        if self._flashinfer is None:
            from pdserve.engine.model_executor.attention.flashinfer_backend import (  # noqa: PLC0415
                FlashInferMLADecode,  # the CUDA path only: CPU never loads it
            )

            plan = mla_decode_plan(self.dec_pages, self.dec_lens_host, self.page_size)
            self._flashinfer = FlashInferMLADecode(plan, num_heads, shape.kv_lora_rank, shape.qk_rope_head_dim,
                                                   self.page_size, scale, q_dtype, cache.dtype, cache.device)
        return self._flashinfer


class MLAAttention:
    """Layer ``layer_id``'s MLA: x [T, hidden] (normed) -> residual + o_proj(attention)."""

    def __init__(self, shape: MLAShape, plan: KernelPlan, tp: HeadShard, layer_id: int, rope: LatentRope,
                 scale: float):
        s = shape
        if s.num_heads % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the {s.num_heads} attention heads")
        self.shape, self.layer_id, self.rope, self.scale = s, layer_id, rope, scale
        self.heads = s.num_heads // tp.size
        if s.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(plan, s.hidden, s.num_heads * s.qk_head_dim, tp)
        else:
            self.q_a_proj = ReplicatedLinear(plan, s.hidden, s.q_lora_rank, bias=s.attention_bias)
            self.q_a_layernorm = RMSNorm(plan, s.q_lora_rank, s.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(plan, s.q_lora_rank, s.num_heads * s.qk_head_dim, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(plan, s.hidden, s.latent_dim, bias=s.attention_bias)
        self.kv_a_layernorm = RMSNorm(plan, s.kv_lora_rank, s.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(plan, s.kv_lora_rank, s.num_heads * (s.qk_nope_head_dim + s.v_head_dim),
                                              tp)
        self.o_proj = RowParallelLinear(plan, s.num_heads * s.v_head_dim, s.hidden, tp)
        if s.attention_bias:
            raise ValueError("MLA with an o_proj bias is not supported")
        self.w_uk: torch.Tensor | None = None  # [H, nope, r]: folds into the query
        self.w_uv: torch.Tensor | None = None  # [H, v, r]: folds into the output
        self.plan = plan
        # native kernel on CPU where built, torch twin elsewhere (shared by every layer: one binding);
        # FlashInfer's MLA where it applies (CUDA, flashinfer installed, DeepSeek's widths)
        self.decode = mla_decode_fn(torch.device(plan.device))
        self.flashinfer = use_flashinfer_mla(torch.device(plan.device), s.kv_lora_rank, s.qk_rope_head_dim, plan.dtype)

    def absorb(self) -> None:
        """Split kv_b_proj's dense rows into W_UK and W_UV (after load: the absorbed form's weights)."""
        s = self.shape
        w = self.kv_b_proj.method.dense().view(self.heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        self.w_uk = w[:, : s.qk_nope_head_dim].to(self.plan.dtype).contiguous()
        self.w_uv = w[:, s.qk_nope_head_dim :].to(self.plan.dtype).contiguous()

    def forward(self, x: torch.Tensor, h: torch.Tensor, step: Step, pool: PagePool, meta: MLAStep) -> torch.Tensor:
        s, H = self.shape, self.heads
        T = x.shape[0]
        if s.q_lora_rank is None:
            q = self.q_proj.forward(x, step)
        else:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x, step)), step)
        q = q.view(T, H, s.qk_head_dim)
        q_nope, q_pe = q[..., : s.qk_nope_head_dim], self.rope.forward(q[..., s.qk_nope_head_dim :])
        kv_a = self.kv_a_proj_with_mqa.forward(x, step)  # [T, r + dr]
        c = self.kv_a_layernorm.forward(kv_a[:, : s.kv_lora_rank].contiguous())
        k_pe = self.rope.forward(kv_a[:, None, s.kv_lora_rank :])[:, 0]
        latent = torch.cat([c, k_pe], dim=-1)  # [T, r + dr]: what the pool keeps
        cache = pool.k[self.layer_id]
        store_kv(cache, None, meta.loc, latent[:, None], None)
        if meta.all_decode:
            o = self._absorbed(q_nope, q_pe, cache, meta)
        else:
            o = x.new_empty(T, H * s.v_head_dim)
            if meta.dec_rows.numel():
                r = meta.dec_rows
                o[r] = self._absorbed(q_nope[r], q_pe[r], cache, meta)
            for p in meta.prefills:
                o[p.start : p.end] = self._expanded(q_nope[p.start : p.end], q_pe[p.start : p.end],
                                                    latent[p.start : p.end], cache, p, step)
        return self.o_proj.forward(o, step, residual=h)

    def _absorbed(self, q_nope, q_pe, cache, meta: MLAStep) -> torch.Tensor:
        """The step's decode rows: q_nope [n, H, nope], q_pe [n, H, dr] -> [n, H * v] over the latent pages."""
        n = q_nope.shape[0]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [n, H, r]
        q_full = torch.cat([q_lat, q_pe], dim=-1).contiguous()  # [n, H, r + dr]
        # a CUDA graph being captured keeps the twin: FlashInfer plans on the host, which a capture cannot hold
        if self.flashinfer and not (q_full.is_cuda and torch.cuda.is_current_stream_capturing()):
            fi = meta.flashinfer_decode(self.heads, self.shape, self.scale, q_full.dtype, cache)
            o_lat = fi(q_full, cache)  # [n, H, r]
        else:
            o_lat = self.decode(q_full, cache, meta.dec_pages, meta.dec_lens, self.shape.kv_lora_rank,
                                self.scale)  # [n, H, r]
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv.transpose(1, 2))  # [H, n, v]
        return o.transpose(0, 1).reshape(n, -1)

    def _expanded(self, q_nope, q_pe, latent, cache, p: _Prefill, step: Step) -> torch.Tensor:
        """One sequence's new rows: q [n, H, *], its latent (new rows, or all from the pool when a
        prefix is cached) decompressed per head -> [n, H * v]."""
        s, H = self.shape, self.heads
        n = q_nope.shape[0]
        mask = None
        if p.slots is not None:
            latent = gather_slots(cache, p.slots)[:, 0]  # [L, r + dr]
            L = latent.shape[0]
            mask = torch.arange(L, device=latent.device)[None, :] <= torch.arange(L - n, L, device=latent.device)[:, None]
        L = latent.shape[0]
        kv = self.kv_b_proj.forward(latent[:, : s.kv_lora_rank].contiguous(), Step(L, False))
        kv = kv.view(L, H, s.qk_nope_head_dim + s.v_head_dim)
        k = torch.cat([kv[..., : s.qk_nope_head_dim], latent[:, None, s.kv_lora_rank :].expand(L, H, -1)], dim=-1)
        v = kv[..., s.qk_nope_head_dim :]
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=mask is None, scale=self.scale)  # [1, H, n, v]
        return o[0].transpose(0, 1).reshape(n, H * s.v_head_dim)
