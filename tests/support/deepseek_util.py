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


def make_deepseek_checkpoint(kind: str, path: str, **overrides) -> None:
    """``overrides``: config fields over the kind's (``num_hidden_layers``, ``first_k_dense_replace``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                              PreTrainedTokenizerFast)

    torch.manual_seed(0)
    if kind == "v2":
        cfg = DeepseekV2Config(**{**COMMON, **dict(q_lora_rank=None, first_k_dense_replace=0,
                                                   topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                   routed_scaling_factor=1.5, rope_theta=10000.0), **overrides})
        model = DeepseekV2ForCausalLM(cfg)
    else:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        cfg = DeepseekV3Config(**{**COMMON, **dict(q_lora_rank=48, first_k_dense_replace=1, n_group=4, topk_group=2,
                                                   routed_scaling_factor=2.5, norm_topk_prob=True,
                                                   rope_parameters=rope), **overrides})
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


def add_mtp_layer(path: str, copy_last: bool) -> None:
    """Give the checkpoint at ``path`` one MTP layer (``num_nextn_predict_layers`` 1) stored as
    DeepSeek's are, ``model.layers.{num_hidden_layers}.``.

    ``copy_last``: the MTP passes the embedding through (``eh_proj`` = [I | 0], unit norms) into a
    copy of the last layer, ``shared_head`` = the final norm and the LM head, and the embedding's
    rows are scaled to unit RMS (so ``enorm`` leaves them as they are): on a one-layer model the
    MTP at position p then computes the target's step at p + 1 and guesses its greedy tokens.
    Otherwise a random layer (the last layer's tensors plus noise, random norms and ``eh_proj``)
    that shares the target's head (no ``shared_head.head``)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    gen = torch.Generator().manual_seed(7)
    block = {k[len(last):]: v.clone() for k, v in weights.items() if k.startswith(last)}
    if copy_last:
        emb = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
        extra = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                 "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
                 "shared_head.norm.weight": weights["model.norm.weight"].clone(),
                 "shared_head.head.weight": weights["lm_head.weight"].clone()}
    else:
        block = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                 for k, v in block.items()}
        extra = {"enorm.weight": 1 + 0.3 * torch.randn(hidden, generator=gen),
                 "hnorm.weight": 1 + 0.3 * torch.randn(hidden, generator=gen),
                 "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
                 "shared_head.norm.weight": 1 + 0.3 * torch.randn(hidden, generator=gen)}
    weights.update({mtp + k: v.contiguous() for k, v in {**block, **extra}.items()})
    save_file(weights, file, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
