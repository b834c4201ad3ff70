"""A rank's LoRA adapters: read from ``--lora-paths`` at start, their weights put into the model's
slot stacks when the scheduler gives an adapter a slot (``sched/scheduler.py``, ``LoraSlots``).

Every projection an adapter may target gets one ``LoraStacks`` per layer, of
``--max-loras-per-batch`` slots and ``--max-lora-rank`` width, hooked into its linear layer
(a merged q|k|v or gate|up layer holds one per part, over its part's output columns). The
adapters stay in host memory as read; ``load`` copies one into a slot, so the stacks hold only
what the running requests use. The Llama family is served (its projections' names are PEFT's).

Under tensor parallelism each adapter is sharded as its base linear is, with the slices the
linear's ``weight_loader`` takes from the checkpoint: a column-parallel projection (q, k, v, gate,
up) keeps all of A and this rank's output rows of B; a row-parallel one (o, down) keeps this
rank's input columns of A and all of B, so its partial delta joins the base product's partial
sums before the one all-reduce (``RowParallelLinear.forward``).
"""

from __future__ import annotations

import logging
import sys

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.lora_names import parse_lora_paths
from pdserve.engine.model_executor.layers.linear import LinearBase
from pdserve.engine.model_executor.layers.lora_adapter import (LORA_MODULES, LoraAdapter, LoraAdapterError,
                                                               load_lora_adapter)
from pdserve.engine.model_executor.layers.lora_product import LoraHook, LoraStacks
from pdserve.kernels.cpu_lora import LoraKernels

logger = logging.getLogger(__name__)

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def read_adapters(config: EngineConfig, num_layers: int) -> dict[str, LoraAdapter]:
    """Every adapter of ``lora_paths``, checked against ``max_lora_rank`` (LoraAdapterError names
    the adapter and what does not fit)."""
    rank = config.max_lora_rank or sys.maxsize  # None: the slots take the largest adapter's rank
    out = {}
    for name, path in parse_lora_paths(config.lora_paths).items():
        try:
            out[name] = load_lora_adapter(name, path, rank, LORA_MODULES, num_layers)
        except (LoraAdapterError, OSError) as e:  # a start-up error naming the entry
            raise LoraAdapterError(f"lora_paths {name}={path}: {e}") from None
    return out


class LoraManager:
    def __init__(self, config: EngineConfig, model, num_layers: int):
        self.adapters = read_adapters(config, num_layers)
        self.num_layers = num_layers
        self.num_slots = config.max_loras_per_batch
        self.r_max = config.max_lora_rank or max((a.rank for a in self.adapters.values()), default=1)
        self.resident: dict[int, str] = {}  # slot -> adapter whose weights are in it
        self.stacks: dict[tuple[int, str], LoraStacks] = {}
        # (layer, module) -> this rank's (rows of B, columns of A) of the full adapter
        self.shards: dict[tuple[int, str], tuple[slice, slice]] = {}
        self.attach(model)
        logger.info("LoRA: %d adapter(s) %s, %d slots of rank %d", len(self.adapters), sorted(self.adapters),
                    self.num_slots, self.r_max)

    def attach(self, model) -> None:
        """Hook stacks into ``model``'s projections (again after its weights were replaced) and
        put back the adapters the slots held."""
        self.stacks = {}
        self.shards = {}
        packed = getattr(model, "packed_modules_mapping", {})
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
            raise ValueError(f"LoRA serves the Llama family; {type(model).__name__} is not supported")
        dtype, device = torch.float32, model.plan.device
        # the native segmented product where the model runs bf16 on the CPU (its kernels built)
        native = model.plan.native
        kernels = LoraKernels(native) if native is not None and model.plan.dtype == torch.bfloat16 else None
        for i, layer in enumerate(layers):
            hooks: dict[int, tuple[LinearBase, list[tuple[slice, LoraStacks]]]] = {}
            for module in LORA_MODULES:
                owner = layer.self_attn if module in _ATTENTION else layer.mlp
                attr, shard = packed.get(module, (module, None))
                linear = getattr(owner, attr, None)
                if not isinstance(linear, LinearBase) or shard not in linear.parts:
                    raise ValueError(f"LoRA: layer {i} has no {module} projection to adapt")
                cols, src_rows, src_cols = linear.parts[shard]
                out_features = cols.stop - cols.start
                stacks = LoraStacks(self.num_slots, self.r_max, linear.shape[1], out_features, dtype, device)
                self.stacks[(i, module)] = stacks
                self.shards[(i, module)] = (src_rows, src_cols)
                hooks.setdefault(id(linear), (linear, []))[1].append((cols, stacks))
            for linear, parts in hooks.values():
                linear.lora = LoraHook(parts, swiglu=linear.swiglu, kernels=kernels)
        for slot, name in self.resident.items():
            self.load(slot, name)

    def add(self, name: str, path: str) -> LoraAdapter:
        """Read adapter ``name`` from ``path`` to serve it from now on (``/load_lora_adapter``);
        LoraAdapterError when it does not fit the slots (rank above theirs, a module or layer the
        model has not)."""
        if name in self.adapters:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already loaded")
        try:
            adapter = load_lora_adapter(name, path, self.r_max, LORA_MODULES, self.num_layers)
        except OSError as e:
            raise LoraAdapterError(f"{path}: {e}") from None
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str, slot: int | None) -> None:
        """Stop serving ``name`` (no request uses it); ``slot``: the slot it held, emptied."""
        self.adapters.pop(name, None)
        if slot is not None:
            for stacks in self.stacks.values():
                stacks.clear(slot)
            self.resident.pop(slot, None)

    def load(self, slot: int, name: str) -> None:
        """Put this rank's shard of adapter ``name``'s A and B in ``slot`` of every projection (zeros
        where it has none)."""
        adapter = self.adapters[name]
        for key, stacks in self.stacks.items():
            ab = adapter.weights.get(key)
            if ab is None:
                stacks.set(slot, None, None, adapter.scaling)
                continue
            rows, cols = self.shards[key]
            a, b = ab  # A [r, in], B [out, r]
            stacks.set(slot, a[:, cols], b[rows], adapter.scaling)
        self.resident[slot] = name
