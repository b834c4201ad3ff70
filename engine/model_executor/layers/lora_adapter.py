"""A LoRA adapter read from a PEFT checkpoint directory: per layer and projection, its A and B and scaling.

PEFT writes ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ...) and ``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``:
A [r, in_features] and B [out_features, r]; a row's output gains
``scaling * B @ A @ x`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).

Only what pdserve applies is accepted, and anything else is refused with a
message naming it: the attention and MLP projections of the decoder layers,
ranks up to ``--max-lora-rank``, no bias, no DoRA, no per-module ranks.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# the projections an adapter may target (PEFT's names, as the checkpoint's modules are named)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served here; the message names the file, key or setting."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer index, module name) -> (A [rank, in], B [out, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoraAdapterError(f"{path!r} is not a PEFT adapter: it has no adapter_config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as e:
        raise LoraAdapterError(f"{cfg_path}: not JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, allowed in (("bias", ("none", None)), ("use_dora", (False, None)), ("rank_pattern", ({}, None)),
                         ("alpha_pattern", ({}, None)), ("fan_in_fan_out", (False, None))):
        if cfg.get(key) not in allowed:
            raise LoraAdapterError(f"{cfg_path}: {key}={cfg.get(key)!r} is not supported")
    return cfg


def load_lora_adapter(name: str, path: str, max_rank: int, target_modules: tuple[str, ...] = LORA_MODULES,
                      num_layers: int | None = None) -> LoraAdapter:
    """Read the PEFT adapter at ``path``; LoraAdapterError when it does not fit this server's settings."""
    cfg = _config(path)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraAdapterError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise LoraAdapterError(f"{path!r} has no adapter_model.safetensors")
    from safetensors.torch import load_file

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoraAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in target_modules:
            raise LoraAdapterError(f"adapter {name!r} targets {module}, not among --lora-target-modules "
                                   f"{', '.join(target_modules)}")
        if num_layers is not None and layer >= num_layers:
            raise LoraAdapterError(f"adapter {name!r} has layer {layer}; the model has {num_layers}")
        parts.setdefault((layer, module), {})[ab] = tensor.float()
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraAdapterError(f"adapter {name!r}: layer {layer} {module} lacks A [r, in] and B [out, r] "
                                   f"of rank {rank}")
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise LoraAdapterError(f"adapter {name!r} holds no LoRA weights")
    return LoraAdapter(name, path, rank, scaling, weights)
