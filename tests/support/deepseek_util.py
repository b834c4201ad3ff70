"""Tiny random DeepSeek checkpoints made with transformers, for the MLA tests.

- ``v2``: no q LoRA, softmax scores, group-limited greedy routing, one shared expert, all layers MoE.
- ``v3``: q LoRA, sigmoid scores with a correction bias, 4 groups of which 2 chosen, a dense first
  layer, YaRN rope (factor 4, mscale, mscale_all_dim), renormalized and scaled weights.
"""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
              max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1, eos_token_id=2,
              bos_token_id=1, pad_token_id=0)


def make_deepseek_checkpoint(kind: str, path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                              PreTrainedTokenizerFast)

    torch.manual_seed(0)
    if kind == "v2":
        cfg = DeepseekV2Config(q_lora_rank=None, first_k_dense_replace=0, topk_method="group_limited_greedy",
                               n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_theta=10000.0, **COMMON)
        model = DeepseekV2ForCausalLM(cfg)
    else:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        cfg = DeepseekV3Config(q_lora_rank=48, first_k_dense_replace=1, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=rope, **COMMON)
        model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # norms at 1 and a zero bias would hide mistakes: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(path)
