"""The mixture-of-experts layer's interface: ``FusedMoE`` owns E experts' gate|up and down
matrices (each sharded over the TP ranks on the intermediate dimension, as a dense MLP is) and
routes every token to its top-k experts through a ``MoEMethod`` chosen at load.

``PerExpertMoEMethod`` is the reference method: one ``LinearMethod`` per expert matrix, so every
weight format (bf16, w8a16, w8a8, Q8_0) and its step-size dispatch hold per expert, each expert
stepping by its own token count. A fused CPU expert kernel is another ``MoEMethod``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.linear_method import LinearMethod, linear_method
from pdserve.engine.model_executor.parallel import HeadShard, all_reduce


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}


def expert_weight_name(name: str) -> tuple[str, str, int] | None:
    """``model.layers.3.mlp.experts.7.up_proj.weight`` (or Mixtral's ``w3``) -> (``model.layers.3.
    mlp.experts.weight``, "w3", 7): the ``FusedMoE`` at ``...experts``, its shard and expert; None
    for any other name. A model with experts returns this from its ``expert_weight_name``."""
    m = _EXPERT.fullmatch(name)
    return None if m is None else (f"{m.group(1)}.weight", _EXPERT_SHARDS[m.group(3)], int(m.group(2)))


class MoEMethod(ABC):
    """How E experts' weights are held and multiplied. w13: [E, 2 I, K] (gate | up of this rank's
    I intermediate rows), w2: [E, K, I]."""

    def __init__(self, plan: KernelPlan, num_experts: int):
        self.plan = plan
        self.num_experts = num_experts

    @abstractmethod
    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Build the forms from the loaded matrices (model dtype); they may be dropped afterwards."""

    @abstractmethod
    def apply(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]): x [T, K], topk_weights [T, k]
        float32, topk_ids [T, k] int64 -> [T, K] in x's dtype (this rank's partial sums under TP)."""

    @abstractmethod
    def dense(self, expert: int, shard_id: str) -> torch.Tensor:
        """Expert ``expert``'s float32 matrix ``shard_id`` ("w1" gate, "w3" up, "w2" down), this rank's."""


class PerExpertMoEMethod(MoEMethod):
    """Each expert a SwiGLU gate|up and a down ``LinearMethod``; tokens gathered per expert."""

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13: list[LinearMethod] = [linear_method(self.plan, swiglu=True) for _ in range(self.num_experts)]
        self.w2: list[LinearMethod] = [linear_method(self.plan) for _ in range(self.num_experts)]
        for e in range(self.num_experts):
            self.w13[e].prepare(w13[e])
            self.w2[e].prepare(w2[e])

    def apply(self, x, topk_weights, topk_ids, step):
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, K]
        for e in topk_ids.unique().tolist():
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)  # tokens routed to e
            expert_step = Step(rows.numel(), step.decode)
            y = self.w2[e].apply(self.w13[e].apply(x[rows], expert_step), expert_step)  # [n, K]
            out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None])
        return out.to(x.dtype)

    def dense(self, expert: int, shard_id: str) -> torch.Tensor:
        if shard_id == "w2":
            return self.w2[expert].dense()
        w13 = self.w13[expert].dense()
        inter = w13.shape[0] // 2
        return w13[:inter] if shard_id == "w1" else w13[inter:]


class FusedMoE:
    """E routed experts (SwiGLU), sharded over TP on the intermediate dimension. ``weight_loader``
    takes a checkpoint expert matrix: ``shard_id`` "w1" (gate), "w3" (up) or "w2" (down) of
    ``expert_id``; ``forward`` routes by the router's logits (softmax, top-k, renormalized when
    ``renormalize``), adds the residual after the all-reduce."""

    def __init__(self, plan: KernelPlan, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 tp: HeadShard, renormalize: bool = True, method: MoEMethod | None = None):
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size = tp.size
        inter = intermediate // tp.size
        self.rows = slice(tp.rank * inter, (tp.rank + 1) * inter)
        self.inter = inter
        self.w13: torch.Tensor | None = torch.empty(num_experts, 2 * inter, hidden, dtype=plan.dtype,
                                                    device=plan.device)
        self.w2: torch.Tensor | None = torch.empty(num_experts, hidden, inter, dtype=plan.dtype, device=plan.device)
        self.method = method or PerExpertMoEMethod(plan, num_experts)

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        if shard_id == "w1":
            self.w13[expert_id, : self.inter].copy_(loaded[self.rows])
        elif shard_id == "w3":
            self.w13[expert_id, self.inter :].copy_(loaded[self.rows])
        elif shard_id == "w2":
            self.w2[expert_id].copy_(loaded[:, self.rows])
        else:
            raise ValueError(f"expert shard_id must be w1, w2 or w3, got {shard_id!r}")

    def process_weights(self) -> None:
        """Hand the loaded matrices to the method (once)."""
        if self.w13 is None:
            return
        self.method.prepare(self.w13, self.w2)
        self.w13 = self.w2 = None

    def read_back(self, param: str, shard_id: str, expert_id: int) -> torch.Tensor:
        """Expert ``expert_id``'s float32 matrix ``shard_id`` of this rank (``get_weights_by_name``)."""
        return self.method.dense(expert_id, shard_id)

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, step: Step,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> residual + all_reduce(experts' weighted sum), [T, hidden]."""
        weights, ids = self.select_experts(router_logits)
        return self.forward_routed(x, weights, ids, step, residual)

    def forward_routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` with the routing chosen by the caller (a model's own gate): topk_weights
        [T, k] float32, topk_ids [T, k] int64 -> residual + all_reduce(weighted sum), [T, hidden]."""
        y = self.method.apply(x, topk_weights, topk_ids, step)
        if self.tp_size > 1:
            y = all_reduce(y)
        return y if residual is None else residual + y
