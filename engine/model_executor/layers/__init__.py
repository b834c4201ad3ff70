"""Model layers that own their weights: each slices its tensor-parallel share and fuses merged
parts through ``weight_loader``, and multiplies through a ``LinearMethod`` for its weight format
chosen at load (``KernelPlan``), dispatching by step size inside itself. A model
(``models/``) composes them and names its checkpoint's tensors."""

from pdserve.engine.model_executor.layers.attention import Attention
from pdserve.engine.model_executor.layers.kernel_plan import GEMV_MAX_ROWS, KernelPlan, Step, can_prepack
from pdserve.engine.model_executor.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                                         QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
from pdserve.engine.model_executor.layers.linear_method import (Int8LinearMethod, LinearMethod,
                                                                UnquantizedLinearMethod, W8A8LinearMethod,
                                                                linear_method)
from pdserve.engine.model_executor.layers.moe import FusedMoE, MoEMethod, PerExpertMoEMethod
from pdserve.engine.model_executor.layers.norm import QKNorm, RMSNorm, rms_norm
from pdserve.engine.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from pdserve.engine.model_executor.layers.vocab import ParallelLMHead, VocabEmbedding

__all__ = [
    "Attention", "ColumnParallelLinear", "FusedMoE", "GEMV_MAX_ROWS", "Int8LinearMethod", "KernelPlan",
    "LinearBase", "LinearMethod", "MergedColumnParallelLinear", "MoEMethod", "ParallelLMHead", "PerExpertMoEMethod",
    "QKNorm", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "Step",
    "UnquantizedLinearMethod", "VocabEmbedding", "W8A8LinearMethod", "can_prepack", "linear_method", "rms_norm",
    "rope_inv_freq",
]
