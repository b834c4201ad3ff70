"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, also R1 and Kimi-K2's layout): DeepSeek-V2's layers
(``deepseek_v2.py``) with V3's router: sigmoid scores, ``e_score_correction_bias`` added to the
scores that choose (noaux_tc), groups scored by their best two experts, the k weights
renormalized when ``norm_topk_prob``; rope pairs interleaved unless ``rope_interleave`` is false."""

from __future__ import annotations

from pdserve.engine.model_executor.layers.deepseek_gate import GateConfig
from pdserve.engine.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
from pdserve.engine.model_executor.models.registry import register_model


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def rope_interleaved(cfg: dict) -> bool:
        return bool(cfg.get("rope_interleave", True))

    @staticmethod
    def gate_config(cfg: dict) -> tuple[GateConfig, bool]:
        method = cfg.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ValueError(f"DeepSeek-V3 topk_method {method!r} is not supported (supported: noaux_tc)")
        return GateConfig(num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                          scoring=cfg.get("scoring_func", "sigmoid"), n_group=int(cfg.get("n_group") or 1),
                          topk_group=int(cfg.get("topk_group") or 1), group_score="top2",
                          norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                          routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0))), True
