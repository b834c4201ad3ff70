"""A loaded model's weight by its Hugging Face name (SGLang's ``get_weights_by_name``).

The model holds fused matrices (q|k|v, gate|up), some packed (in panels, for gemv, or for oneDNN) or as
int8 with scales; this maps a checkpoint name back to its rows of the fused
matrix, dense float32, so a caller can compare it with the checkpoint.
Under TP the answer is this rank's shard (its heads, its MLP columns or rows).
"""

from __future__ import annotations

import re

import torch

from pdserve.engine.model_executor.quantization import dense

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _matrix(model, plain, row_major) -> torch.Tensor:
    """The dense form of one of a layer's matrices: the plain one (or its panels), unless it is
    prepacked for oneDNN (then the copy native gemv reads, when there is one)."""
    if not model.packed or model.gemm:
        return dense(plain, torch.float32)
    if row_major is not None:
        return dense(row_major, torch.float32)
    raise ValueError("this weight is held only in oneDNN's prepacked layout (bf16 without native gemv); "
                     "start with --dtype float32 or without --disable-decode-gemv to read it")


def weight_by_name(model, name: str) -> torch.Tensor:
    """This rank's float32 copy of checkpoint weight ``name``; ValueError when there is no such weight."""
    arch = model.arch
    if name == "model.embed_tokens.weight" or (name == "lm_head.weight" and arch.tie_word_embeddings):
        return model.embed.float()
    if name == "model.norm.weight":
        return model.final_norm.float()
    if name == "lm_head.weight":
        head = _matrix(model, model.lm_head, model.lm_head_g)
        return head[: min(head.shape[0], arch.vocab_size - model.tp.rank * model.vocab_shard)]
    m = _LAYER.fullmatch(name)
    if m is None or int(m.group(1)) >= len(model.layers):
        raise ValueError(f"no weight named {name!r}")
    layer, rest = model.layers[int(m.group(1))], m.group(2)
    H, KVH, D = model.num_heads, model.num_kv_heads, arch.head_dim
    qkv_rows = {"q_proj": slice(0, H * D), "k_proj": slice(H * D, (H + KVH) * D),
                "v_proj": slice((H + KVH) * D, (H + 2 * KVH) * D)}
    proj, _, kind = rest.removeprefix("self_attn.").removeprefix("mlp.").partition(".")
    if rest == "input_layernorm.weight":
        return layer.input_norm.float()
    if rest == "post_attention_layernorm.weight":
        return layer.post_norm.float()
    if proj in qkv_rows and kind == "weight":
        return _matrix(model, layer.qkv_w, layer.qkv_g)[qkv_rows[proj]]
    if proj in qkv_rows and kind == "bias" and layer.qkv_b is not None:
        return layer.qkv_b[qkv_rows[proj]].float()
    if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and layer.qk_norm is not None:
        return layer.qk_norm[0 if proj == "q_norm" else H].float()
    if rest == "self_attn.o_proj.weight":
        return _matrix(model, layer.o_w, layer.o_g)
    if rest == "mlp.down_proj.weight":
        return _matrix(model, layer.down_w, layer.down_g)
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        gate_up = _matrix(model, layer.gate_up_w, layer.gate_up_g)
        return gate_up[: model.inter] if proj == "gate_proj" else gate_up[model.inter :]
    raise ValueError(f"no weight named {name!r}")
