"""A loaded model's weight by its Hugging Face name (SGLang's ``get_weights_by_name``).

The name resolves to the layer holding it (``layers/loader.py``: a merged layer's part, a tied
tensor's source), which reads it back from its prepared forms (panels, gemv's packing, int8 with
scales), dense float32, so a caller can compare it with the checkpoint. Under TP the answer is
this rank's shard (its heads, its MLP columns or rows).
"""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.layers.loader import resolve
from pdserve.engine.model_executor.models.base import CausalLM


def weight_by_name(model: CausalLM, name: str) -> torch.Tensor:
    """This rank's float32 copy of checkpoint weight ``name``; ValueError when there is no such weight."""
    if name in model.tied_weights and model.arch.tie_word_embeddings:
        name = model.tied_weights[name]
    try:
        layer, param, shard_id, expert_id = resolve(model, name)
    except ValueError:
        raise ValueError(f"no weight named {name!r}") from None
    if expert_id is not None:
        return layer.read_back(param, shard_id, expert_id)
    if hasattr(layer, "read_back"):
        return layer.read_back(param, shard_id)
    if param != "weight" or not isinstance(getattr(layer, "weight", None), torch.Tensor):
        raise ValueError(f"no weight named {name!r}")
    return layer.weight.float()
