"""Which expert-parallel rank holds each routed expert of a MoE layer, and at which local index.

Pure bookkeeping, no tensors of weights: ``FusedMoE`` loads only its rank's experts from it and
turns it into the id map its exchange uses. The default gives rank ``r`` of ``n`` the experts
``[r * E/n, (r + 1) * E/n)``, in order, as SGLang's and vLLM's EP do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """``owner[e]``: the EP rank holding expert ``e``; ``local[e]``: its index among that rank's."""

    owner: tuple[int, ...]
    local: tuple[int, ...]
    ep_size: int

    def experts_of(self, rank: int) -> list[int]:
        """Rank ``rank``'s experts, by local index."""
        held = sorted((self.local[e], e) for e, r in enumerate(self.owner) if r == rank)
        return [e for _, e in held]

    def local_ids(self, rank: int) -> list[int]:
        """For every expert, its local index on ``rank``, or -1 where another rank holds it."""
        return [self.local[e] if r == rank else -1 for e, r in enumerate(self.owner)]


def contiguous_placement(num_experts: int, ep_size: int) -> ExpertPlacement:
    """``ep_size`` equal runs of consecutive experts; ValueError naming both when they do not divide."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the model's {num_experts} routed experts")
    per_rank = num_experts // ep_size
    return ExpertPlacement(tuple(e // per_rank for e in range(num_experts)),
                           tuple(e % per_rank for e in range(num_experts)), ep_size)
