"""RMSNorm as transformers' LlamaRMSNorm: statistics in float32, round to the model dtype,
then scale. The native one-pass kernel (same roundings) where the plan runs native kernels."""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference: x [..., N], weight broadcast over its last dims."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm:
    """weight [hidden] in the model dtype."""

    def __init__(self, plan: KernelPlan, hidden: int, eps: float):
        self.native = plan.native
        self.eps = eps
        self.weight = torch.empty(hidden, dtype=plan.dtype, device=plan.device)

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        self.weight.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.native is not None:
            return self.native.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class QKNorm:
    """Qwen3's per-head RMSNorm of q and k before rope, over q|k viewed as [T, H + KVH, D]:
    weight [H + KVH, D], q_norm's repeated per query head then k_norm's per KV head (``shard_id``
    "q" or "k"). Always torch's float32 mean (the C kernel sums in another order)."""

    def __init__(self, plan: KernelPlan, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        self.eps = eps
        self.num_heads = num_heads
        self.weight = torch.empty(num_heads + num_kv_heads, head_dim, dtype=plan.dtype, device=plan.device)

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        rows = slice(0, self.num_heads) if shard_id == "q" else slice(self.num_heads, None)
        self.weight[rows].copy_(loaded.expand_as(self.weight[rows]))

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        return rms_norm(qk, self.weight, self.eps)

    def read_back(self, param: str = "weight", shard_id: str | None = None) -> torch.Tensor:
        return self.weight[0 if shard_id == "q" else self.num_heads].float()
