"""Loading a model's weights through its layers' ``weight_loader``s (nano-vllm's loader).

A model names its layers as the checkpoint names its tensors (``model.layers.3.self_attn`` is
``model.model.layers[3].self_attn``); its ``packed_modules_mapping`` maps a checkpoint part
to the merged layer holding it (``q_proj`` -> (``qkv_proj``, "q")), its ``expert_weight_name``
an expert's tensor to its ``FusedMoE`` (``moe.expert_weight_name``), and
``tied_weights`` a tensor absent from the checkpoint to the one it shares
(``lm_head.weight`` -> ``model.embed_tokens.weight``). Each layer slices its TP share and
stacks merged parts itself; ``process_weights`` then hands every linear's matrix to its method.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pdserve.engine.model_executor.layers.linear import LinearBase
from pdserve.engine.model_executor.layers.moe import FusedMoE


def get_module(model: Any, path: str) -> Any:
    """The object at dotted ``path`` below ``model`` (list items by index); AttributeError if none."""
    obj = model
    for part in path.split("."):
        if part.isdigit() and isinstance(obj, list):
            index = int(part)
            if index >= len(obj):
                raise AttributeError(path)
            obj = obj[index]
        else:
            obj = getattr(obj, part)
    return obj


def iter_modules(obj: Any, prefix: str = "", seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """(dotted path, layer) of every object with a ``weight_loader`` below ``obj``, each once
    (under the first path that reaches it)."""
    seen = set() if seen is None else seen
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if not hasattr(item, "__dict__") or isinstance(item, torch.Tensor) or id(item) in seen:
                continue
            seen.add(id(item))
            path = f"{prefix}{name}" if i is None else f"{prefix}{name}.{i}"
            if hasattr(item, "weight_loader"):
                yield path, item
            if type(item).__module__.startswith("pdserve.engine.model_executor"):
                yield from iter_modules(item, path + ".", seen)


def resolve(model: Any, name: str) -> tuple[Any, str, str | None, int | None]:
    """(layer, parameter name, shard id, expert id) that checkpoint tensor ``name`` loads into."""
    shard_id, expert_id = None, None
    mapped = model.expert_weight_name(name)  # a model with experts maps their names first
    if mapped is not None:
        name, shard_id, expert_id = mapped
    else:
        for part, (merged, shard) in model.packed_modules_mapping.items():
            if f".{part}." in name:
                name, shard_id = name.replace(f".{part}.", f".{merged}.", 1), shard
                break
    path, param = name.rsplit(".", 1)
    try:
        return get_module(model, path), param, shard_id, expert_id
    except AttributeError:
        raise ValueError(f"no weight named {name!r} in this model") from None


def load_weights(model: Any, weights: dict[str, torch.Tensor],
                 q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Load ``weights`` (Hugging Face names) into ``model``'s layers, and ``q8_0`` (a GGUF file's
    Q8_0 matrices as stored, ``model_loader.read_q8_0_blocks``) where the linear methods keep int8.
    The decoder layers' linears keep Q8_0 all or none (the fused step takes one kind of scale);
    any other linear (the LM head) on its own."""
    linears = [(path, m) for path, m in iter_modules(model) if isinstance(m, LinearBase)]
    if q8_0:  # first, so that each linear can prepare its forms once its dense parts are in
        _load_q8_0(model, weights, q8_0, linears)
    for name, tensor in weights.items():
        layer, param, shard_id, expert_id = resolve(model, name)
        if expert_id is None:
            layer.weight_loader(param, tensor, shard_id)
        else:
            layer.weight_loader(param, tensor, shard_id, expert_id)
    for name, source in model.tied_weights.items():
        if name not in weights:
            layer, _, _, _ = resolve(model, name)
            layer.tie(resolve(model, source)[0])
    for path, m in linears:
        m.check_loaded(path)
    for _, m in iter_modules(model):
        if isinstance(m, (LinearBase, FusedMoE)):
            m.process_weights()


def _load_q8_0(model: Any, weights: dict[str, torch.Tensor], q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]],
               linears: list[tuple[str, LinearBase]]) -> None:
    names = dict(q8_0)
    for name, source in model.tied_weights.items():
        if name not in weights and source in q8_0:
            names[name] = q8_0[source]
    for name, (q, d) in names.items():
        layer, param, shard_id, _ = resolve(model, name)
        if isinstance(layer, LinearBase) and param == "weight":
            layer.load_q8_0(q, d, shard_id)
    groups: dict[str, list[LinearBase]] = {}
    for path, m in linears:
        groups.setdefault("layers" if path.startswith("model.layers.") else path, []).append(m)
    for group in groups.values():
        if not all(m.has_q8_0 for m in group):
            for m in group:
                m.drop_q8_0()
