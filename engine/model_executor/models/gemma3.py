"""Gemma 3's text model (``Gemma3ForCausalLM``): embeddings scaled by sqrt(hidden) and tied to
the LM head; Gemma's RMSNorm (weight offset from one) before and after both the attention and
the MLP; per-head q/k norm; a GeLU(tanh)-gated MLP; query scale ``query_pre_attn_scalar ** -0.5``;
layers alternating between sliding-window attention (local rope base) and full attention (global
rope base, optionally linearly scaled); the final logits optionally soft-capped
(``cap * tanh(logits / cap)``). Attention-logit soft-capping (Gemma 2's) is refused: no attention
backend applies it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.layers import (Attention, KernelPlan, MergedColumnParallelLinear, ParallelLMHead,
                                                  QKVParallelLinear, RotaryEmbedding, RowParallelLinear, Step,
                                                  VocabEmbedding, rope_inv_freq)
from pdserve.engine.model_executor.layers.gemma_norm import GemmaRMSNorm
from pdserve.engine.model_executor.layers.sliding_window import SlidingWindowAttention, SlidingWindowStep
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.models.base import CausalLM
from pdserve.engine.model_executor.models.registry import register_model
from pdserve.engine.model_executor.parallel import HeadShard
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend


@dataclass(frozen=True)
class GemmaConfig:
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer
    window: int
    scaling: float  # the attention's score scale
    final_softcap: float | None
    local_theta: float
    global_theta: float
    global_linear_factor: float

    @classmethod
    def from_arch(cls, arch: ModelArch) -> "GemmaConfig":
        cfg = json.loads(arch.hf_config)
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (no attention backend soft-caps scores)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {cfg['hidden_activation']!r} is not supported")
        types = cfg.get("layer_types")
        if types is None:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(arch.num_layers)]
        rope = cfg.get("rope_parameters") or {}
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        if not full:  # the older flat form: rope_theta, rope_local_base_freq, rope_scaling for the global layers
            full = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 1_000_000.0))
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
        for name, params in (("full_attention", full), ("sliding_attention", local)):
            if params.get("rope_type", "default") not in ("default", "linear"):
                raise ValueError(f"{name} rope type {params['rope_type']!r} is not supported")
        factor = float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0
        cap = cfg.get("final_logit_softcapping")
        return cls(sliding=tuple(t == "sliding_attention" for t in types), window=int(cfg.get("sliding_window") or 0),
                   scaling=float(cfg.get("query_pre_attn_scalar", arch.head_dim)) ** -0.5,
                   final_softcap=None if cap is None else float(cap), local_theta=float(local["rope_theta"]),
                   global_theta=float(full["rope_theta"]), global_linear_factor=factor)


class Gemma3Attention:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, layer_id: int, rotary: RotaryEmbedding,
                 gemma: GemmaConfig, window: SlidingWindowStep | None):
        D = arch.head_dim
        self.heads, self.kv_heads, self.head_dim = tp.num_heads, tp.num_kv_heads, D
        self.scaling = gemma.scaling
        self.qkv_proj = QKVParallelLinear(plan, arch.hidden_size, D, tp)
        self.q_norm = GemmaRMSNorm(plan, D, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(plan, D, arch.rms_norm_eps)
        self.o_proj = RowParallelLinear(plan, arch.num_heads * D, arch.hidden_size, tp)
        self.rotary = rotary
        if gemma.sliding[layer_id]:
            self.attn = SlidingWindowAttention(tp.num_heads, tp.num_kv_heads, D, layer_id, window)
        else:
            self.attn = Attention(tp.num_heads, tp.num_kv_heads, D, layer_id)

    def forward(self, x: torch.Tensor, step: Step, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] (normed) -> o_proj(attention) all-reduced, [T, hidden]."""
        T, H, KVH, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x, step)  # [T, (H + 2 KVH) D]
        q = self.q_norm.forward(qkv[:, : H * D].view(T, H, D))
        k = self.k_norm.forward(qkv[:, H * D : (H + KVH) * D].view(T, KVH, D))
        qk = self.rotary.forward(torch.cat([q, k], dim=1))  # [T, H + KVH, D]
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        q = qk[:, :H]
        if self.scaling != attn.scale:  # the backend scales by its own factor: q carries the rest
            q = q * (self.scaling / attn.scale)
        if isinstance(self.attn, SlidingWindowAttention):
            o = self.attn.forward(q, qk[:, H:], v, attn, batch)
        else:
            o = self.attn.forward(q, qk[:, H:], v, attn)  # [T, H D]
        return self.o_proj.forward(o, step)


class Gemma3MLP:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard):
        self.gate_up_proj = MergedColumnParallelLinear(plan, arch.hidden_size, arch.intermediate_size, tp,
                                                       ("gate", "up"))
        self.down_proj = RowParallelLinear(plan, arch.intermediate_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        gu = self.gate_up_proj.forward(x, step)  # [T, 2 I]
        inter = gu.shape[1] // 2
        return self.down_proj.forward(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], step)


class Gemma3DecoderLayer:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, layer_id: int, rotary: RotaryEmbedding,
                 gemma: GemmaConfig, window: SlidingWindowStep | None):
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(plan, hidden, eps)
        self.self_attn = Gemma3Attention(arch, plan, tp, layer_id, rotary, gemma, window)
        self.post_attention_layernorm = GemmaRMSNorm(plan, hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(plan, hidden, eps)
        self.mlp = Gemma3MLP(arch, plan, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(plan, hidden, eps)

    def forward(self, h: torch.Tensor, step: Step, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        a = self.self_attn.forward(self.input_layernorm.forward(h), step, attn, batch)
        h = h + self.post_attention_layernorm.forward(a)
        m = self.mlp.forward(self.pre_feedforward_layernorm.forward(h), step)
        return h + self.post_feedforward_layernorm.forward(m)


class Gemma3Model:
    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, gemma: GemmaConfig):
        D, ctx = arch.head_dim, arch.max_context_len
        self.local_rotary = RotaryEmbedding(plan, rope_inv_freq(D, gemma.local_theta), ctx)
        self.global_rotary = RotaryEmbedding(plan, rope_inv_freq(D, gemma.global_theta, gemma.global_linear_factor),
                                             ctx)
        self.embed_tokens = VocabEmbedding(plan, arch.vocab_size, arch.hidden_size)
        # transformers multiplies by sqrt(hidden) rounded to the model dtype
        self.normalizer = torch.tensor(arch.hidden_size**0.5, dtype=plan.dtype)
        # the sliding layers' per-step plan, built once per step (None: no sliding layer)
        self.window = SlidingWindowStep(gemma.window) if any(gemma.sliding) else None
        self.layers = [Gemma3DecoderLayer(arch, plan, tp, i,
                                          self.local_rotary if gemma.sliding[i] else self.global_rotary, gemma,
                                          self.window)
                       for i in range(arch.num_layers)]
        self.norm = GemmaRMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(CausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, fused_decode: bool = True):
        """``fused_decode`` (Llama's decode step in one native call) has no form for these layers."""
        super().__init__(arch, plan, tp)
        gemma = GemmaConfig.from_arch(arch)
        if len(gemma.sliding) != arch.num_layers or (any(gemma.sliding) and gemma.window < 1):
            raise ValueError("layer_types must name every layer, and sliding layers need a sliding_window")
        self.final_softcap = gemma.final_softcap
        self.model = Gemma3Model(arch, plan, tp, gemma)
        self.lm_head = ParallelLMHead(plan, arch.vocab_size, arch.hidden_size, tp)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32; ``attn.begin_forward(batch)`` already ran."""
        step = Step(batch.input_ids.shape[0], batch.is_decode)
        model = self.model
        model.local_rotary.begin_step(batch.positions)
        model.global_rotary.begin_step(batch.positions)
        if model.window is not None:
            model.window.begin_step(batch, attn.page_pool.page_size)
        h = model.embed_tokens.forward(batch.input_ids) * model.normalizer  # [T, hidden]
        for i, layer in enumerate(model.layers):
            h = layer.forward(h, step, attn, batch)
            if after_layer is not None:
                after_layer(i)
        logits = self.sampled_logits(h, batch, model.norm, self.lm_head)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
