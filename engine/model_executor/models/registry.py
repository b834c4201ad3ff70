"""Models by their Hugging Face architecture name (``config.json``'s ``architectures``).

A model file registers its class with ``@register_model("LlamaForCausalLM", ...)``; every
module of this package is imported at the first lookup, so a new model is one new file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
import pkgutil

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.models.base import CausalLM
from pdserve.engine.model_executor.parallel import HeadShard, head_shard
from pdserve.engine.quantization_names import UNQUANTIZED

_MODELS: dict[str, type[CausalLM]] = {}
_NOT_MODELS = {"base", "registry"}


def register_model(*names: str):
    """Class decorator: serve ``names`` (HF architecture names) with the class."""
    def register(cls: type[CausalLM]) -> type[CausalLM]:
        for name in names:
            if _MODELS.get(name, cls) is not cls:
                raise ValueError(f"architecture {name!r} is already registered by {_MODELS[name].__name__}")
            _MODELS[name] = cls
        return cls
    return register


def _import_models() -> None:
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _NOT_MODELS:
            importlib.import_module(f"{__package__}.{info.name}")


def registered_models() -> dict[str, type[CausalLM]]:
    _import_models()
    return dict(_MODELS)


def model_class(architecture: str) -> type[CausalLM]:
    models = registered_models()
    if architecture not in models:
        raise ValueError(f"architecture {architecture!r} is not supported (supported: {sorted(models)})")
    return models[architecture]


def build_model(arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                prepack: bool = False, tp: HeadShard | None = None, quantization: str = UNQUANTIZED, gemv: bool = True,
                fused_decode: bool = True, gemm: bool = True, lora: bool = False,
                q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                before_load: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """``arch``'s model with ``weights`` loaded (HF names), its kernels chosen
    (``KernelPlan.choose``: ``prepack``, ``gemv``, ``gemm``, ``quantization``; ``fused_decode``:
    small decode steps' layers in one native call where the model allows it; ``lora``: the
    projections stay unfused for LoRA deltas). ``q8_0``: a GGUF
    file's Q8_0 matrices as stored, kept as int8 where the weights are int8. ``before_load``: runs on
    the built model before its weights load (the runner places the MoE layers' experts there)."""
    arch.check_tp_size(1 if tp is None else tp.size)
    tp = tp or head_shard(0, 1, arch.num_heads, arch.num_kv_heads)
    plan = KernelPlan.choose(dtype, device, quantization, prepack=prepack, gemv=gemv, gemm=gemm, lora=lora)
    model = model_class(arch.architecture)(arch, plan, tp, fused_decode=fused_decode)
    if before_load is not None:
        before_load(model)
    model.load_weights(weights, q8_0)
    return model
