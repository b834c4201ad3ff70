"""The native fused decode step's view of a model (``decode_step.DecodeStack``): a dense decoder
layer's norms and linears, read through their methods' prepared forms (gemv's packed copy and,
with the native panel products, the panels), never through a model's internals.

A model offers it by returning ``DenseLayerParts`` per layer from ``fused_decode_parts()``;
``FusedDecode`` builds the stack for the attention backend's page pool and runs a step. Under
LoRA a step whose rows use adapters runs there too, the linears' ``LoraHook``s handing their
native weights to the stack (``DecodeStack.set_lora``), where every hook runs the native kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan
from pdserve.engine.model_executor.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                                         RowParallelLinear)
from pdserve.engine.model_executor.layers.lora_product import LoraHook, LoraRows
from pdserve.engine.model_executor.layers.norm import RMSNorm
from pdserve.engine.model_executor.layers.rotary import RotaryEmbedding
from pdserve.engine.model_executor.layers.vocab import ParallelLMHead
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend
from pdserve.kernels.decode_step import DecodeLayerTensors, DecodeShape, DecodeStack


@dataclass(frozen=True)
class DenseLayerParts:
    """One pre-norm decoder layer as the fused step runs it: norm, q|k|v (+bias), rope, attention,
    o + residual, norm, SwiGLU gate|up, down + residual."""

    input_norm: RMSNorm
    qkv: QKVParallelLinear
    o: RowParallelLinear
    post_norm: RMSNorm
    gate_up: MergedColumnParallelLinear
    down: RowParallelLinear


@dataclass(frozen=True)
class DenseModelParts:
    layers: list[DenseLayerParts]
    final_norm: RMSNorm
    lm_head: ParallelLMHead
    rotary: RotaryEmbedding
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    eps: float


class FusedDecode:
    """Decode steps of at most ``max_rows`` rows through one DecodeStack call per step."""

    def __init__(self, plan: KernelPlan, parts: DenseModelParts, max_rows: int):
        self.plan, self.parts, self.max_rows = plan, parts, max_rows
        # built at the first fused step for its page pool, known by (id, first K tensor's address)
        self.stack: DecodeStack | None = None
        self._pool_key: tuple[int, int] | None = None

    def can_run(self, batch: ForwardBatch) -> bool:
        """The step fits, and any LoRA rows can take their deltas inside the call."""
        return (batch.input_ids.shape[0] <= self.max_rows and 0 < batch.logits_indices.numel() <= self.max_rows
                and (batch.lora_slots is None or self._lora_native()))

    def _hooks(self, lp: DenseLayerParts) -> tuple[LoraHook | None, ...]:
        return tuple(lin.lora if lin.lora is not None and lin.lora.parts else None
                     for lin in (lp.qkv, lp.o, lp.gate_up, lp.down))

    def _lora_native(self) -> bool:
        """Every adapter hook of the model runs the native kernel (bf16 on the CPU, not switched off)."""
        return LoraHook.native and all(hook.kernels is not None for lp in self.parts.layers
                                       for hook in self._hooks(lp) if hook is not None)

    def _set_lora(self, stack: DecodeStack) -> None:
        """Point each layer of ``stack`` at its hooks' native weights (rebuilt where a slot changed)."""
        for i, lp in enumerate(self.parts.layers):
            stack.set_lora(i, tuple(None if hook is None else hook.native_weights().address
                                    for hook in self._hooks(lp)))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                pages: tuple[torch.Tensor, torch.Tensor], after_layer: Callable[[int], None] | None) -> torch.Tensor:
        """Logits (this rank's vocabulary rows) of an all-decode step; h [T, hidden] embedded.
        ``after_layer``: one call per layer, each once the layer (its K/V store included) is done."""
        stack = self._stack(attn)
        page_table, seq_lens = pages
        lora = LoraRows.of(batch.lora_slots)
        row_slots = None
        if lora is not None:
            self._set_lora(stack)
            row_slots = lora.slots32()
        sel = batch.logits_indices.contiguous()
        logits = torch.empty(sel.numel(), stack.vocab, dtype=stack.logits_dtype(h.shape[0]))
        step = (h, batch.positions.contiguous(), batch.out_cache_loc.contiguous(), page_table, seq_lens)
        last = len(self.parts.layers)
        if after_layer is None:
            stack.run(*step, 0, last, sel, logits, row_slots)
        else:
            for i in range(last):
                stack.run(*step, i, i + 1, sel, logits if i == last - 1 else None, row_slots)
                after_layer(i)
        return logits

    def _stack(self, attn: AttentionBackend) -> DecodeStack:
        pool = attn.page_pool
        key = (id(pool), pool.k[0].data_ptr())
        if self.stack is not None and self._pool_key == key:
            return self.stack
        slot_stride, head_stride, dim_stride = pool.k_slots(0).stride()
        assert dim_stride == 1 and pool.v_slots(0).stride() == (slot_stride, head_stride, 1)
        p, gemm = self.parts, self.plan.gemm

        def panels(*linears: LinearBase):
            return tuple(lin.method.large for lin in linears) if gemm else None

        layers = [DecodeLayerTensors(lp.input_norm.weight, lp.qkv.method.gemv, lp.qkv.bias, lp.o.method.gemv,
                                     lp.post_norm.weight, lp.gate_up.method.gemv, lp.down.method.gemv,
                                     pool.k[i], pool.v[i], panels(lp.qkv, lp.o, lp.gate_up, lp.down))
                  for i, lp in enumerate(p.layers)]
        shape = DecodeShape(p.num_heads, p.num_kv_heads, p.head_dim, pool.page_size, p.eps, attn.scale,
                            slot_stride, head_stride)
        head = p.lm_head.method
        self.stack = DecodeStack(self.plan.native, shape, layers, p.final_norm.weight, head.gemv, p.rotary.cos,
                                 p.rotary.sin, self.plan.gemv_rows, head.large if gemm else None)
        self._pool_key = key
        return self.stack
