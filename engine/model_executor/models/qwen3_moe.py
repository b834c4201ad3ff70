"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm before rope)
and, in place of the dense MLP, a router picking each token's top-k of E experts (softmax, then
renormalized over the k when ``norm_topk_prob``) whose SwiGLU outputs are summed by weight.
Experts are sharded over the TP ranks by their intermediate rows, or placed whole on the EP
ranks (``FusedMoE``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor import dp_attention
from pdserve.engine.model_executor.layers import (Attention, FusedMoE, KernelPlan, ParallelLMHead,
                                                  QKNorm, QKVParallelLinear, RMSNorm, ReplicatedLinear,
                                                  RotaryEmbedding, RowParallelLinear, Step, VocabEmbedding, rope_inv_freq)
from pdserve.engine.model_executor.layers.moe import expert_weight_name
from pdserve.engine.model_executor.layers.moe_fused import moe_method
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.models.base import CausalLM
from pdserve.engine.model_executor.models.registry import register_model
from pdserve.engine.model_executor.parallel import HeadShard
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    moe_intermediate: int
    norm_topk_prob: bool

    @classmethod
    def from_arch(cls, arch: ModelArch) -> "MoeConfig":
        cfg = json.loads(arch.hf_config)
        sparse = cfg.get("decoder_sparse_step", 1) == 1 and not cfg.get("mlp_only_layers")
        if not sparse:
            raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported")
        return cls(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                   top_k=int(cfg["num_experts_per_tok"]), moe_intermediate=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))


class Qwen3MoeAttention:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, layer_id: int, rotary: RotaryEmbedding):
        D = arch.head_dim
        self.heads, self.kv_heads, self.head_dim = tp.num_heads, tp.num_kv_heads, D
        self.qkv_proj = QKVParallelLinear(plan, arch.hidden_size, D, tp)
        self.qk_norm = QKNorm(plan, tp.num_heads, tp.num_kv_heads, D, arch.rms_norm_eps)
        self.o_proj = RowParallelLinear(plan, arch.num_heads * D, arch.hidden_size, tp)
        self.rotary = rotary
        self.attn = Attention(tp.num_heads, tp.num_kv_heads, D, layer_id)

    def forward(self, x: torch.Tensor, h: torch.Tensor, step: Step, attn: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] (normed) -> h + o_proj(attention), [T, hidden]."""
        T, H, KVH, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x, step)  # [T, (H + 2 KVH) D]
        qk = self.rotary.forward(self.qk_norm.forward(qkv[:, : (H + KVH) * D].view(T, H + KVH, D)))
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        o = self.attn.forward(qk[:, :H], qk[:, H:], v, attn)  # [T, H D]
        return self.o_proj.forward(o, step, residual=h)


class Qwen3MoeSparseBlock:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, moe: MoeConfig):
        E, hidden = moe.num_experts, arch.hidden_size
        self.gate = ReplicatedLinear(plan, hidden, E)  # every rank routes every token alike
        # under DP attention the experts split over every attention group (dp_attention.mlp_shard)
        self.experts = FusedMoE(plan, E, moe.top_k, hidden, moe.moe_intermediate, dp_attention.mlp_shard(tp),
                                renormalize=moe.norm_topk_prob, method=moe_method(plan, E))

    def _route(self, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        return self.experts.select_experts(self.gate.forward(x, step))

    def forward(self, x: torch.Tensor, h: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] (normed) -> h + the routed experts' sum, [T, hidden]; under DP attention
        over every attention group's experts (``FusedMoE.forward_dp_attention``)."""
        if dp_attention.enabled():
            return self.experts.forward_dp_attention(x, self._route, step, h)
        return self.experts.forward(x, self.gate.forward(x, step), step, residual=h)


class Qwen3MoeDecoderLayer:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, layer_id: int, rotary: RotaryEmbedding,
                 moe: MoeConfig):
        self.input_layernorm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Qwen3MoeAttention(arch, plan, tp, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)
        self.mlp = Qwen3MoeSparseBlock(arch, plan, tp, moe)

    def forward(self, h: torch.Tensor, step: Step, attn: AttentionBackend) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(h), h, step, attn)
        return self.mlp.forward(self.post_attention_layernorm.forward(h), h, step)


class Qwen3MoeModel:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, moe: MoeConfig):
        rotary = RotaryEmbedding(plan, rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_linear_factor,
                                                     arch.rope_llama3_scaling), arch.max_context_len)
        self.rotary = rotary
        self.embed_tokens = VocabEmbedding(plan, arch.vocab_size, arch.hidden_size)
        self.layers = [Qwen3MoeDecoderLayer(arch, plan, tp, i, rotary, moe) for i in range(arch.num_layers)]
        self.norm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(CausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "q_norm": ("qk_norm", "q"), "k_norm": ("qk_norm", "k")}
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    dp_attention = True

    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, fused_decode: bool = True):
        """``fused_decode`` (Llama's decode step in one native call) has no form for these layers."""
        super().__init__(arch, plan, tp)
        moe = MoeConfig.from_arch(arch)  # FusedMoE checks that the TP/EP group can split the experts
        self.model = Qwen3MoeModel(arch, plan, tp, moe)
        self.lm_head = ParallelLMHead(plan, arch.vocab_size, arch.hidden_size, tp)

    def expert_weight_name(self, name: str) -> tuple[str, str, int] | None:
        return expert_weight_name(name)  # HF's per-expert names: experts.{e}.{gate,up,down}_proj

    def idle_forward(self) -> None:
        """Under DP attention, a forward of no rows: every layer's expert collectives, nothing else."""
        hidden = torch.empty(0, self.arch.hidden_size, dtype=self.plan.dtype, device=self.plan.device)
        for layer in self.model.layers:
            layer.mlp.forward(hidden, hidden, Step(0, False))

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32; ``attn.begin_forward(batch)`` already ran."""
        step = Step(batch.input_ids.shape[0], batch.is_decode)
        model = self.model
        model.rotary.begin_step(batch.positions)
        h = model.embed_tokens.forward(batch.input_ids)  # [T, hidden]
        for i, layer in enumerate(model.layers):
            h = layer.forward(h, step, attn)
            if after_layer is not None:
                after_layer(i)
        return self.sampled_logits(h, batch, model.norm, self.lm_head)
