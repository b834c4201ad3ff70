"""DeepSeek's router: each token's top-k routed experts and their weights, from the gate's
logits (computed in float32, as the checkpoints keep the gate).

- scores: softmax (DeepSeek-V2) or sigmoid (V3); V3 adds ``e_score_correction_bias`` to the
  scores that *choose* (noaux_tc) while the weights stay the plain scores.
- groups: with ``n_group`` > 1 the experts form groups; a group's score is its best expert's
  (V2's group_limited_greedy) or the sum of its best two (V3), only the ``topk_group`` best groups
  stay eligible.
- weights: renormalized over the k when ``norm_topk_prob``, then times ``routed_scaling_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GateConfig:
    num_experts: int
    top_k: int
    scoring: str  # "softmax" or "sigmoid"
    n_group: int
    topk_group: int
    group_score: str  # "max" (V2) or "top2" (V3)
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be softmax or sigmoid, got {self.scoring!r}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} does not divide the {self.num_experts} routed experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in 1..n_group ({self.n_group}), got {self.topk_group}")


def grouped_topk(logits: torch.Tensor, cfg: GateConfig,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 (and the correction bias [E]) -> (weights [T, k] float32, ids [T, k] int64)."""
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, cfg.n_group, E // cfg.n_group)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep[:, :, None].expand(-1, -1, E // cfg.n_group).reshape(T, E)
        # V2 zeroes the dropped softmax scores (all positive); V3 makes them unchoosable
        choice = choice.masked_fill(~keep, 0.0 if cfg.group_score == "max" else float("-inf"))
    ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class DeepseekGate:
    """The router's weight [E, hidden] and correction bias [E], both kept float32."""

    def __init__(self, cfg: GateConfig, hidden: int, device: torch.device | str, with_bias: bool):
        self.cfg = cfg
        self.weight = torch.empty(cfg.num_experts, hidden, dtype=torch.float32, device=device)
        self.e_score_correction_bias = (torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
                                        if with_bias else None)

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        target = getattr(self, param, None)
        if target is None:
            raise ValueError(f"this gate has no {param}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, ids [T, k])."""
        logits = torch.nn.functional.linear(x.float(), self.weight)  # [T, E]
        return grouped_topk(logits, self.cfg, self.e_score_correction_bias)
