"""DeepSeek's multi-token-prediction (MTP) layer: the draft head NEXTN speculates with.

A DeepSeek-V2/V3 checkpoint with ``num_nextn_predict_layers`` > 0 stores its MTP layers past the
model's own, as ``model.layers.{num_hidden_layers + i}.``: ``enorm`` and ``hnorm`` (RMSNorms),
``eh_proj`` (hidden x 2 hidden), one decoder block (MLA, and MoE or a dense MLP as
``first_k_dense_replace`` says for that index), ``shared_head.norm`` and ``shared_head.head``
(the checkpoint's copy of the LM head; absent, the target's is used, as is the target's
embedding unless the layer stores its own ``embed_tokens``).

At position p, from the target's final-normed hidden state h_p and the next token t_{p+1}:
``x = eh_proj(cat(enorm(embed(t_{p+1})), hnorm(h_p)))``, the block over the MTP's own KV, then
``shared_head.norm``: that hidden state's logits guess t_{p+2}, and it is the ``h`` of the MTP's
next position when drafts are chained (SGLang's convention: both hidden states are the normed ones).
"""

from __future__ import annotations

import json
import os

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.fp8_block import check_fp8_block_config, dequant_checkpoint
from pdserve.engine.model_executor.layers import KernelPlan, ParallelLMHead, RMSNorm, Step, VocabEmbedding
from pdserve.engine.model_executor.layers.linear import ReplicatedLinear
from pdserve.engine.model_executor.layers.loader import load_weights
from pdserve.engine.model_executor.layers.mla_attention import MLAStep
from pdserve.engine.model_executor.layers.moe import expert_weight_name
from pdserve.engine.model_executor.model_loader import read_safetensors
from pdserve.engine.model_executor.layers.yarn_rope import LatentRope, rope_parameters, softmax_scale
from pdserve.engine.model_executor.models.deepseek_v2 import DeepseekDecoderLayer, DeepseekV2ForCausalLM, mla_shape


def num_nextn_layers(cfg: dict) -> int:
    return int(cfg.get("num_nextn_predict_layers") or 0)


class SharedHead:
    def __init__(self, plan: KernelPlan, cfg: dict, tp, own_head: bool):
        self.norm = RMSNorm(plan, cfg["hidden_size"], float(cfg.get("rms_norm_eps", 1e-6)))
        if own_head:
            self.head = ParallelLMHead(plan, cfg["vocab_size"], cfg["hidden_size"], tp)


class MTPLayer:
    """One MTP layer, its tensors named as the checkpoint names them below ``model.layers.{n}.``."""

    def __init__(self, cfg: dict, plan: KernelPlan, tp, layer_index: int, rope: LatentRope, scale: float,
                 target: DeepseekV2ForCausalLM, own_embed: bool, own_head: bool, kv_layer: int = 0):
        hidden, eps = cfg["hidden_size"], float(cfg.get("rms_norm_eps", 1e-6))
        self.enorm = RMSNorm(plan, hidden, eps)
        self.hnorm = RMSNorm(plan, hidden, eps)
        self.eh_proj = ReplicatedLinear(plan, 2 * hidden, hidden)
        gate, gate_bias = target.gate_config(cfg)
        dense = layer_index < int(cfg.get("first_k_dense_replace", 0))
        # its KV goes to layer ``kv_layer`` of the pool it runs over: 0 of the MTP's own one-layer
        # pool, or the last layer of a PD prefill's pool, whose pages carry it to the decode
        block = DeepseekDecoderLayer(cfg, plan, tp, kv_layer, rope, scale, None if dense else gate, gate_bias)
        self.input_layernorm, self.self_attn = block.input_layernorm, block.self_attn
        self.post_attention_layernorm, self.mlp = block.post_attention_layernorm, block.mlp
        self._block = block
        self.shared_head = SharedHead(plan, cfg, tp, own_head)
        if own_embed:
            self.embed_tokens = VocabEmbedding(plan, cfg["vocab_size"], hidden)
        self._embed = self.embed_tokens if own_embed else target.model.embed_tokens
        self._head = self.shared_head.head if own_head else target.lm_head


class DeepseekMTP:
    """The checkpoint's first MTP layer over a one-layer latent pool, built beside ``target`` (the
    loaded DeepSeek model, whose kernel plan, TP shard, embedding and head it shares). ``kv_layer``:
    the pool layer its KV goes to (0 of its own pool; a PD prefill's MTP writes the target pool's
    last layer, ``speculative/nextn_prompt.py``)."""

    packed_modules_mapping = DeepseekV2ForCausalLM.packed_modules_mapping
    tied_weights: dict[str, str] = {}

    def __init__(self, target: DeepseekV2ForCausalLM, model_path: str, kv_layer: int = 0):
        cfg = target.cfg
        if num_nextn_layers(cfg) < 1:
            raise ValueError(f"speculative_algorithm NEXTN needs a checkpoint with MTP layers "
                             f"(num_nextn_predict_layers > 0); {model_path!r} has none")
        arch, plan, tp = target.arch, target.plan, target.tp
        first = arch.num_layers
        weights = read_layer_weights(model_path, first)
        if not weights:
            raise ValueError(f"speculative_algorithm NEXTN: {model_path!r} says num_nextn_predict_layers "
                             f"{num_nextn_layers(cfg)} but stores no tensor model.layers.{first}.*")
        qc = cfg.get("quantization_config")
        if qc is not None:
            weights = dequant_checkpoint(weights, check_fp8_block_config(qc))
        own_embed = "embed_tokens.weight" in weights
        own_head = "shared_head.head.weight" in weights
        self.plan, self.cfg = plan, cfg
        shape = mla_shape(cfg)
        rope = rope_parameters(cfg)
        self.rope = LatentRope(rope, shape.qk_rope_head_dim, arch.max_context_len, target.rope_interleaved(cfg),
                               plan.dtype, plan.device)
        self.layers = [MTPLayer(cfg, plan, tp, first, self.rope, softmax_scale(rope, shape.qk_head_dim), target,
                                own_embed, own_head, kv_layer)]
        load_weights(self, {f"layers.0.{k}": v for k, v in weights.items()})
        self.layers[0].self_attn.absorb()
        self.hidden_size = arch.hidden_size

    def expert_weight_name(self, name: str) -> tuple[str, str, int] | None:
        return expert_weight_name(name)

    def idle_forward(self) -> None:
        """Under DP attention, a forward of no rows beside another group's MTP step: the block's
        MLP or expert collectives (its attention and head collectives stay in the group)."""
        hidden = torch.empty(0, self.hidden_size, dtype=self.plan.dtype, device=self.plan.device)
        self.layers[0].mlp.forward(hidden, Step(0, False), residual=hidden)

    def forward(self, batch: ForwardBatch, pool, hidden: torch.Tensor, logits: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step over ``pool`` (latent; its KV into layer ``kv_layer``): row r feeds token
        ``batch.input_ids[r]`` with the hidden state ``hidden[r]`` of the position before it. Returns
        the logits of ``batch.logits_indices`` (float32 [n, vocab]; None without ``logits``: only the
        KV was wanted) and every row's output hidden state [T, hidden]."""
        layer = self.layers[0]
        meta = MLAStep(batch, pool.page_size)
        step = Step(batch.input_ids.shape[0], batch.is_decode)
        self.rope.begin_step(batch.positions)
        e = layer.enorm.forward(layer._embed.forward(batch.input_ids))
        x = layer.eh_proj.forward(torch.cat([e, layer.hnorm.forward(hidden.to(e.dtype))], dim=-1), step)
        h = layer.shared_head.norm.forward(layer._block.forward(x, step, pool, meta))
        if not logits:
            return None, h
        rows = h.index_select(0, batch.logits_indices)
        return layer._head.forward(rows, Step(rows.shape[0], batch.is_decode)), h


def read_layer_weights(model_path: str, layer: int) -> dict[str, torch.Tensor]:
    """The tensors under ``model.layers.{layer}.`` of a safetensors checkpoint directory, that prefix
    cut (only they are read, not the whole model again)."""
    if not os.path.isdir(model_path) or not os.path.exists(os.path.join(model_path, "config.json")):
        raise ValueError(f"speculative_algorithm NEXTN reads the MTP layers of a safetensors checkpoint "
                         f"directory; {model_path!r} is not one")
    return read_safetensors(model_path, f"model.layers.{layer}.")


def checkpoint_nextn_layers(model_path: str) -> int:
    """``num_nextn_predict_layers`` of the checkpoint's config.json (0 when absent or unreadable)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return num_nextn_layers(json.load(f))
    except (OSError, ValueError, TypeError):
        return 0
