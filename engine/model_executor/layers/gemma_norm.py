"""Gemma's RMSNorm: the weight is stored as an offset from one, and the scaling happens in
float32 before the rounding to the model dtype (transformers' ``Gemma3RMSNorm``), where
Llama's rounds first and scales in the model dtype."""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan


class GemmaRMSNorm:
    """weight [dim] (the checkpoint's, one subtracted); normalizes the last dimension."""

    def __init__(self, plan: KernelPlan, dim: int, eps: float):
        self.eps = eps
        self.weight = torch.empty(dim, dtype=plan.dtype, device=plan.device)

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        self.weight.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim] in x's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
