"""``FusedMoEMethod``: a ``FusedMoE`` layer's experts held as two stacked tensors and run in one
call of the fused expert kernel (``kernels/cpu_moe.py``: native on CPU in bf16 and float32,
its torch path elsewhere), and ``moe_method``, the choice between it and the per-expert method.

The per-expert method runs one gather, two linear methods and an index_add per expert that
received tokens; the fused kernel groups the step's tokens by expert once and streams each
selected expert's weights once, with no Python per expert. It takes unquantized weights only;
a quantized plan keeps ``PerExpertMoEMethod`` (its linear methods hold int8 per expert).
"""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.moe import MoEMethod, PerExpertMoEMethod
from pdserve.kernels.cpu_moe import MoeKernels, fused_experts
from pdserve.kernels.cpu_native import native_kernels


class FusedMoEMethod(MoEMethod):
    """w13 [E, 2 I, K] and w2 [E, K, I] as loaded (model dtype, contiguous), multiplied by the
    fused kernel."""

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()
        native = native_kernels() if w13.device.type == "cpu" else None
        self.kernels = MoeKernels(native) if native is not None else None

    def apply(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step) -> torch.Tensor:
        # x: [T, K]; topk_weights, topk_ids: [T, k] -> [T, K]
        return fused_experts(x.contiguous(), self.w13, self.w2, topk_ids, topk_weights, self.kernels)

    def dense(self, expert: int, shard_id: str) -> torch.Tensor:
        if shard_id == "w2":
            return self.w2[expert].float()
        inter = self.w13.shape[1] // 2
        return self.w13[expert, :inter].float() if shard_id == "w1" else self.w13[expert, inter:].float()


def moe_method(plan: KernelPlan, num_experts: int) -> MoEMethod:
    """The fused kernel for unquantized weights, per-expert linear methods for int8 ones."""
    if plan.quantized:
        return PerExpertMoEMethod(plan, num_experts)
    return FusedMoEMethod(plan, num_experts)
