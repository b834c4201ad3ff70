"""One model for the Llama family: Llama, SmolLM2, Mistral (no sliding window), Qwen2, Qwen3.

Differences are switches on ModelArch: q/k/v bias (Qwen2), per-head q/k
RMSNorm before rope (Qwen3). Weights arrive with Hugging Face names and are
fused at load (q|k|v into one matrix, gate|up into one) so a layer is four
matmuls. The forward is plain functions over tensors rather than nn.Module
calls: at decode a step runs ~20 small ops per layer and module dispatch
would be a visible share of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelArch
from pdserve.kernels.attention_backend import AttentionBackend


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv_w: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_b: torch.Tensor | None  # [(H + 2 KVH) * D]
    qk_norm: torch.Tensor | None  # [H + KVH, D]: q_norm repeated per q head, then k_norm per kv head
    o_w: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up_w: torch.Tensor  # [2 * inter, hidden]
    down_w: torch.Tensor  # [hidden, inter]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: statistics in float32, round to the model dtype, then scale
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """[D / 2] float32 inverse frequencies, with llama3 or linear scaling as transformers does it."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_linear_factor != 1.0:
        inv_freq = inv_freq / arch.rope_linear_factor
    if arch.rope_llama3_scaling is not None:
        factor, low, high, orig = arch.rope_llama3_scaling
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class LlamaForCausalLM:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device):
        self.arch = arch
        self.dtype = dtype
        self.device = device

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name!r}")
            return weights[name].to(device=device, dtype=dtype)

        H, KVH, D = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        self.final_norm = w("model.norm.weight")
        self.lm_head = self.embed if arch.tie_word_embeddings else w("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_b = None
            if arch.attention_bias:
                qkv_b = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            qk_norm = None
            if arch.qk_norm:
                qk_norm = torch.cat([w(a + "q_norm.weight").expand(H, D), w(a + "k_norm.weight").expand(KVH, D)])
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv_w=torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                qkv_b=qkv_b,
                qk_norm=qk_norm,
                o_w=w(a + "o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up_w=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down_w=w(p + "mlp.down_proj.weight"),
            ))
        # rope tables as transformers builds them: float32 angles, cast to the model dtype
        positions = torch.arange(arch.max_context_len, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(arch))  # [ctx, D / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [ctx, D]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32; ``attn.begin_forward(batch)`` already ran."""
        arch = self.arch
        H, KVH, D, eps = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps
        inter = arch.intermediate_size
        qk_end = (H + KVH) * D
        T = batch.input_ids.shape[0]
        h = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        cos = self.cos.index_select(0, batch.positions)[:, None, :]  # [T, 1, D]
        sin = self.sin.index_select(0, batch.positions)[:, None, :]
        half = D // 2
        for i, layer in enumerate(self.layers):
            x = _rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)  # [T, (H + 2 KVH) * D]
            qk = qkv[:, :qk_end].view(T, H + KVH, D)
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, layer.qk_norm, eps)
            # rotate_half rope on q and k together: x * cos + [-x2, x1] * sin
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin  # [T, H + KVH, D]
            v = qkv[:, qk_end:].view(T, KVH, D)
            o = attn.forward(qk[:, :H], qk[:, H:], v, i)  # [T, H * D]
            h = h + F.linear(o, layer.o_w)
            x = _rms_norm(h, layer.post_norm, eps)
            gu = F.linear(x, layer.gate_up_w)  # [T, 2 * inter]
            h = h + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], layer.down_w)
        h = h.index_select(0, batch.logits_indices)  # [num_sampled, hidden]
        return F.linear(_rms_norm(h, self.final_norm, eps), self.lm_head).float()
