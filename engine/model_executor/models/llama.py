"""The Llama family: Llama, SmolLM2, Mistral (no sliding window), Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm before rope), composed of ``layers/``. Layers are named as the checkpoint
names its tensors; q|k|v and gate|up are merged layers, so a layer is four products."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor import dp_attention
from pdserve.engine.model_executor.layers import (Attention, MergedColumnParallelLinear, ParallelLMHead, QKNorm,
                                                  QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, Step,
                                                  VocabEmbedding, rope_inv_freq)
from pdserve.engine.model_executor.layers.fused_decode import DenseLayerParts, DenseModelParts, FusedDecode
from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan
from pdserve.engine.model_executor.layers.lora_product import LoraRows
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.models.base import CausalLM
from pdserve.engine.model_executor.models.registry import register_model
from pdserve.engine.model_executor.parallel import HeadShard
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend


class LlamaAttention:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, layer_id: int, rotary: RotaryEmbedding):
        H, KVH, D = tp.num_heads, tp.num_kv_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, KVH, D
        self.qkv_proj = QKVParallelLinear(plan, arch.hidden_size, D, tp, bias=arch.attention_bias)
        self.qk_norm = QKNorm(plan, H, KVH, D, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(H, KVH, D, layer_id)
        self.o_proj = RowParallelLinear(plan, arch.num_heads * D, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor, step: Step, attn: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] (normed) -> attention's output [T, H * D], before o_proj."""
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x, step)  # [T, (H + 2 KVH) * D]
        qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
        if self.qk_norm is not None:
            qk = self.qk_norm.forward(qk)
        qk = self.rotary.forward(qk)  # q and k together: [T, H + KVH, D]
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        return self.attn.forward(qk[:, :H], qk[:, H:], v, attn)


class LlamaMLP:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard):
        self.gate_up_proj = MergedColumnParallelLinear(plan, arch.hidden_size, arch.intermediate_size, tp,
                                                       ("gate", "up"), swiglu=True)
        # under DP attention dense_mlp sums the partial products over the world
        self.down_proj = RowParallelLinear(plan, arch.intermediate_size, arch.hidden_size, tp,
                                           reduce=dp_attention.mlp_reduces())

    def forward(self, x: torch.Tensor, step: Step, residual: torch.Tensor, last: bool = False) -> torch.Tensor:
        """residual + down(SiLU(gate(x)) * up(x)), [T, hidden]; under DP attention over every
        attention group's rows (``dp_attention.dense_mlp``; ``last``: the sampled rows alone)."""
        if dp_attention.enabled():
            return dp_attention.dense_mlp(lambda rows: self._partial(rows, step), x, residual, last)
        return self.down_proj.forward(self.gate_up_proj.forward(x, step), step, residual)

    def _partial(self, rows: torch.Tensor, step: Step) -> torch.Tensor:
        """This group's unreduced slice of the MLP over the gathered ``rows``."""
        gathered = Step(rows.shape[0], step.decode)
        return self.down_proj.forward(self.gate_up_proj.forward(rows, gathered), gathered)

    def join_idle(self, hidden: torch.Tensor, last: bool) -> None:
        """Under DP attention: take part in the other groups' MLP with no rows of this group's."""
        empty = hidden[:0]
        dp_attention.dense_mlp(lambda rows: self._partial(rows, Step(0, False)), empty, empty, last)


class LlamaDecoderLayer:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, layer_id: int, rotary: RotaryEmbedding):
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, plan, tp, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch, plan, dp_attention.mlp_shard(tp))

    def forward(self, h: torch.Tensor, step: Step, attn: AttentionBackend, after_layer: Callable[[int], None] | None,
                rows: torch.Tensor | None) -> torch.Tensor | None:
        """h [T, hidden] -> [T, hidden]; ``rows``: only these rows past attention (the last layer;
        none: the K/V store alone, None returned)."""
        o = self.self_attn.forward(self.input_layernorm.forward(h), step, attn)  # [T, H * D]
        if after_layer is not None:
            after_layer(self.layer_id)
        if rows is not None and rows.numel() == 0:
            if dp_attention.enabled():
                self.mlp.join_idle(h, last=True)
            return None
        if rows is not None:
            o, h = o.index_select(0, rows), h.index_select(0, rows)
            step = step.narrow(rows)
        h = self.self_attn.o_proj.forward(o, step, residual=h)
        return self.mlp.forward(self.post_attention_layernorm.forward(h), step, residual=h, last=rows is not None)

    def fused_parts(self) -> DenseLayerParts:
        return DenseLayerParts(self.input_layernorm, self.self_attn.qkv_proj, self.self_attn.o_proj,
                               self.post_attention_layernorm, self.mlp.gate_up_proj, self.mlp.down_proj)


class LlamaModel:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, rotary: RotaryEmbedding):
        self.embed_tokens = VocabEmbedding(plan, arch.vocab_size, arch.hidden_size)
        self.layers = [LlamaDecoderLayer(arch, plan, tp, i, rotary) for i in range(arch.num_layers)]
        self.norm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
                              "q_norm": ("qk_norm", "q"), "k_norm": ("qk_norm", "k")}
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    dp_attention = True

    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, fused_decode: bool = True):
        super().__init__(arch, plan, tp)
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_linear_factor, arch.rope_llama3_scaling)
        self.rotary = RotaryEmbedding(plan, inv_freq, arch.max_context_len)
        self.model = LlamaModel(arch, plan, tp, self.rotary)
        self.lm_head = ParallelLMHead(plan, arch.vocab_size, arch.hidden_size, tp)
        # the fused decode runs every layer in one native call: no room for DP attention's collectives
        rows = plan.fused_rows(fused_decode and not dp_attention.enabled(), tp.size, arch.qk_norm)
        self.fused = FusedDecode(plan, self._dense_parts(), rows) if rows else None

    def idle_forward(self) -> None:
        """Under DP attention, a forward of no rows: every layer's MLP collectives, nothing else."""
        hidden = torch.empty(0, self.arch.hidden_size, dtype=self.plan.dtype, device=self.plan.device)
        layers = self.model.layers
        for layer in layers:
            layer.mlp.join_idle(hidden, last=layer is layers[-1])

    def _dense_parts(self) -> DenseModelParts:
        return DenseModelParts([layer.fused_parts() for layer in self.model.layers], self.model.norm, self.lm_head,
                               self.rotary, self.tp.num_heads, self.tp.num_kv_heads, self.arch.head_dim,
                               self.arch.rms_norm_eps)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        h = self.model.embed_tokens.forward(batch.input_ids)  # [T, hidden]
        if self.fused is not None and self.fused.can_run(batch):
            pages = attn.native_decode_pages()
            if pages is not None:
                return self.lm_head.gather(self.fused.forward(h, batch, attn, pages, after_layer))
        step = Step(h.shape[0], batch.is_decode, LoraRows.of(batch.lora_slots))
        self.rotary.begin_step(batch.positions)
        layers = self.model.layers
        for layer in layers:  # past the last attention only the sampled rows matter
            h = layer.forward(h, step, attn, after_layer, batch.logits_indices if layer is layers[-1] else None)
        if h is None:  # a middle chunk of a chunked prefill: its K/V alone
            return self.no_logits()
        return self.lm_head.forward(self.model.norm.forward(h), step)  # h: [num_sampled, hidden]
