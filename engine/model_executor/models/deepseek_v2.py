"""DeepSeek-V2 (``DeepseekV2ForCausalLM``): multi-head latent attention over a latent KV pool
(``layers/mla_attention.py``), dense SwiGLU MLPs in the first ``first_k_dense_replace`` layers and
DeepSeek MoE blocks after (shared experts plus routed experts, ``layers/deepseek_moe.py``),
routed by softmax scores, greedy or group-limited (``topk_method``). DeepSeek-V3 is this model
with its own router (``deepseek_v3.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor import dp_attention
from pdserve.engine.model_executor.fp8_block import check_fp8_block_config, dequant_checkpoint
from pdserve.engine.model_executor.layers import KernelPlan, ParallelLMHead, RMSNorm, Step, VocabEmbedding
from pdserve.engine.model_executor.layers.deepseek_gate import GateConfig
from pdserve.engine.model_executor.layers.deepseek_moe import DeepseekMLP, DeepseekMoE
from pdserve.engine.model_executor.layers.mla_attention import MLAAttention, MLAShape, MLAStep
from pdserve.engine.model_executor.layers.moe import expert_weight_name
from pdserve.engine.model_executor.layers.yarn_rope import LatentRope, rope_parameters, softmax_scale
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.models.base import CausalLM
from pdserve.engine.model_executor.models.registry import register_model
from pdserve.engine.model_executor.parallel import HeadShard
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend


def mla_shape(cfg: dict) -> MLAShape:
    return MLAShape(hidden=cfg["hidden_size"], num_heads=cfg["num_attention_heads"], q_lora_rank=cfg.get("q_lora_rank"),
                    kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                    attention_bias=bool(cfg.get("attention_bias", False)))


class DeepseekDecoderLayer:
    def __init__(self, cfg: dict, plan: KernelPlan, tp: HeadShard, layer_id: int, rope: LatentRope, scale: float,
                 gate: GateConfig | None, gate_bias: bool):
        hidden, eps = cfg["hidden_size"], float(cfg.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(plan, hidden, eps)
        self.self_attn = MLAAttention(mla_shape(cfg), plan, tp, layer_id, rope, scale)
        self.post_attention_layernorm = RMSNorm(plan, hidden, eps)
        ffn = dp_attention.mlp_shard(tp)  # under DP attention the MLPs and experts split over every group
        if gate is None:
            self.mlp = DeepseekMLP(plan, hidden, cfg["intermediate_size"], ffn)
        else:
            self.mlp = DeepseekMoE(plan, hidden, cfg["moe_intermediate_size"], int(cfg.get("n_shared_experts") or 0),
                                   gate, ffn, gate_bias)

    def forward(self, h: torch.Tensor, step: Step, pool, meta: MLAStep) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(h), h, step, pool, meta)
        return self.mlp.forward(self.post_attention_layernorm.forward(h), step, residual=h)


class DeepseekModel:
    def __init__(self, cfg: dict, arch: ModelArch, plan: KernelPlan, tp: HeadShard, rope: LatentRope, scale: float,
                 gate: GateConfig, gate_bias: bool):
        dense = int(cfg.get("first_k_dense_replace", 0))
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (supported: 1)")
        self.embed_tokens = VocabEmbedding(plan, arch.vocab_size, arch.hidden_size)
        self.layers = [DeepseekDecoderLayer(cfg, plan, tp, i, rope, scale, None if i < dense else gate, gate_bias)
                       for i in range(arch.num_layers)]
        self.norm = RMSNorm(plan, arch.hidden_size, arch.rms_norm_eps)


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(CausalLM):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
    #: every decode and prefill row through the absorbed form (the forms' equality test sets it)
    absorbed_prefill = False
    dp_attention = True

    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard, fused_decode: bool = True):
        """``fused_decode`` (Llama's decode step in one native call) has no form for these layers."""
        super().__init__(arch, plan, tp)
        cfg = json.loads(arch.hf_config)
        self.cfg = cfg
        shape = mla_shape(cfg)
        rope = rope_parameters(cfg)
        self.rope = LatentRope(rope, shape.qk_rope_head_dim, arch.max_context_len, self.rope_interleaved(cfg),
                               plan.dtype, plan.device)
        gate, gate_bias = self.gate_config(cfg)
        self.model = DeepseekModel(cfg, arch, plan, tp, self.rope, softmax_scale(rope, shape.qk_head_dim), gate,
                                   gate_bias)
        self.lm_head = ParallelLMHead(plan, arch.vocab_size, arch.hidden_size, tp)

    @staticmethod
    def rope_interleaved(cfg: dict) -> bool:
        """DeepSeek-V2 turns interleaved pairs of the rope dims."""
        return True

    @staticmethod
    def gate_config(cfg: dict) -> tuple[GateConfig, bool]:
        """V2's router: softmax scores, ``topk_method`` greedy or group_limited_greedy (group = its best expert)."""
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (supported: greedy, "
                             "group_limited_greedy)")
        scoring = cfg.get("scoring_func", "softmax")
        grouped = method == "group_limited_greedy"
        return GateConfig(num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                          scoring=scoring, n_group=int(cfg.get("n_group") or 1) if grouped else 1,
                          topk_group=int(cfg.get("topk_group") or 1) if grouped else 1, group_score="max",
                          norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                          routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0))), False

    def expert_weight_name(self, name: str) -> tuple[str, str, int] | None:
        return expert_weight_name(name)

    def load_weights(self, weights: dict[str, torch.Tensor],
                     q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """FP8 block-quantized checkpoints dequantized first; then each attention's W_UK and W_UV
        split out of its kv_b_proj for the absorbed form. The multi-token-prediction layers past
        ``num_hidden_layers`` are not this model's."""
        qc = self.cfg.get("quantization_config")
        if qc is not None:
            weights = dequant_checkpoint(weights, check_fp8_block_config(qc))
        n = self.arch.num_layers
        weights = {k: v for k, v in weights.items() if not _mtp_layer(k, n)}
        super().load_weights(weights, q8_0)
        for layer in self.model.layers:
            layer.self_attn.absorb()

    def idle_forward(self) -> None:
        """Under DP attention, a forward of no rows: every layer's MLP or expert collectives."""
        hidden = torch.empty(0, self.arch.hidden_size, dtype=self.plan.dtype, device=self.plan.device)
        for layer in self.model.layers:
            layer.mlp.forward(hidden, Step(0, False), residual=hidden)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32; MLA reads the latent pool of ``attn``."""
        pool = attn.page_pool
        meta = MLAStep(batch, pool.page_size, self.absorbed_prefill)
        step = Step(batch.input_ids.shape[0], batch.is_decode)
        self.rope.begin_step(batch.positions)
        h = self.model.embed_tokens.forward(batch.input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            h = layer.forward(h, step, pool, meta)
            if after_layer is not None:
                after_layer(i)
        if not self.keep_hidden:
            return self.sampled_logits(h, batch, self.model.norm, self.lm_head)
        self.last_hidden = h = self.model.norm.forward(h)  # [T, hidden], every row normed (NEXTN)
        return self.sampled_logits(h, batch, None, self.lm_head)


def _mtp_layer(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers
