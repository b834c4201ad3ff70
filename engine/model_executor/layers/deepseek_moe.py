"""DeepSeek's feed-forward blocks: the dense SwiGLU MLP (the first ``first_k_dense_replace``
layers, and the shared experts) and the MoE block, shared experts plus routed experts chosen by
``DeepseekGate`` and run through ``FusedMoE`` (sharded over TP on the intermediate dimension)."""

from __future__ import annotations

import torch

from pdserve.engine.model_executor import dp_attention
from pdserve.engine.model_executor.layers.deepseek_gate import DeepseekGate, GateConfig
from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pdserve.engine.model_executor.layers.moe import FusedMoE
from pdserve.engine.model_executor.layers.moe_fused import moe_method
from pdserve.engine.model_executor.parallel import HeadShard


class DeepseekMLP:
    def __init__(self, plan: KernelPlan, hidden: int, intermediate: int, tp: HeadShard):
        if intermediate % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the MLP's intermediate size {intermediate}")
        self.gate_up_proj = MergedColumnParallelLinear(plan, hidden, intermediate, tp, ("gate", "up"), swiglu=True)
        # under DP attention dense_mlp sums the partial products over the world
        self.down_proj = RowParallelLinear(plan, intermediate, hidden, tp, reduce=dp_attention.mlp_reduces())

    def forward(self, x: torch.Tensor, step: Step, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> residual + down(SiLU(gate(x)) * up(x)); under DP attention (a dense layer)
        over every attention group's rows."""
        if dp_attention.enabled():
            return dp_attention.dense_mlp(lambda rows: self.partial(rows, Step(rows.shape[0], step.decode)), x,
                                          residual)
        return self.down_proj.forward(self.gate_up_proj.forward(x, step), step, residual)

    def partial(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """This rank's unreduced share of the MLP (under DP attention, where the split spans the groups)."""
        return self.down_proj.forward(self.gate_up_proj.forward(x, step), step)


class DeepseekMoE:
    def __init__(self, plan: KernelPlan, hidden: int, moe_intermediate: int, n_shared: int, gate: GateConfig,
                 tp: HeadShard, gate_bias: bool):
        if moe_intermediate % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the experts' intermediate size {moe_intermediate}")
        self.gate = DeepseekGate(gate, hidden, plan.device, gate_bias)
        self.experts = FusedMoE(plan, gate.num_experts, gate.top_k, hidden, moe_intermediate, tp,
                                method=moe_method(plan, gate.num_experts))
        self.shared_experts = DeepseekMLP(plan, hidden, moe_intermediate * n_shared, tp) if n_shared else None

    def forward(self, x: torch.Tensor, step: Step, residual: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed) -> residual + shared(x) + routed experts' weighted sum; under DP
        attention over every attention group's experts (``FusedMoE.forward_dp_attention``)."""
        if dp_attention.enabled():
            shared = None if self.shared_experts is None else self.shared_experts.partial
            return self.experts.forward_dp_attention(x, lambda rows, _: self.gate.forward(rows), step, residual,
                                                     shared)
        if self.shared_experts is not None:
            residual = self.shared_experts.forward(x, step, residual)
        weights, ids = self.gate.forward(x)
        return self.experts.forward_routed(x, weights, ids, step, residual)
