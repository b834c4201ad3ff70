"""Which expert-parallel rank holds each routed expert of a MoE layer, and at which local index.

Pure bookkeeping, no tensors of weights. A layer has P physical expert slots, ``P / ep_size`` per
rank (slot ``p`` is local index ``p % (P / ep_size)`` of rank ``p // (P / ep_size)``), and each slot
holds one logical expert (a checkpoint expert): ``physical_to_logical`` (SGLang's expert-location
map). P is E plus ``--ep-num-redundant-experts``: every logical expert has one or more replicas,
and the router's choice of a logical expert becomes one of its replicas per token
(``replica_table``), so a hot expert's tokens split between its replicas' ranks.

``FusedMoE`` loads its rank's slots from it and turns it into the id maps its exchange uses. The
default (``contiguous_placement``) gives rank ``r`` of ``n`` the experts ``[r * E/n, (r + 1) * E/n)``
in order, as SGLang's and vLLM's EP do; with redundant slots, the replicas go round-robin
(``trivial_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """``physical_to_logical[p]``: the logical expert slot ``p`` holds; ``num_logical``: E."""

    physical_to_logical: tuple[int, ...]
    num_logical: int
    ep_size: int

    def __post_init__(self):
        check_physical_to_logical(list(self.physical_to_logical), self.num_logical, self.ep_size)

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    @property
    def owner(self) -> tuple[int, ...]:
        """Per physical slot, the EP rank holding it."""
        return tuple(p // self.slots_per_rank for p in range(self.num_physical))

    @property
    def local(self) -> tuple[int, ...]:
        """Per physical slot, its index among its rank's slots."""
        return tuple(p % self.slots_per_rank for p in range(self.num_physical))

    @property
    def is_identity(self) -> bool:
        """One slot per expert, slot ``e`` holding expert ``e``: routing needs no map."""
        return self.physical_to_logical == tuple(range(self.num_logical))

    def experts_of(self, rank: int) -> list[int]:
        """Rank ``rank``'s logical experts, by local index (an expert may fill two slots)."""
        s = self.slots_per_rank
        return list(self.physical_to_logical[rank * s : (rank + 1) * s])

    def local_ids(self, rank: int) -> list[int]:
        """For every physical slot, its local index on ``rank``, or -1 where another rank holds it."""
        s = self.slots_per_rank
        return [p % s if p // s == rank else -1 for p in range(self.num_physical)]

    def replicas(self) -> list[list[int]]:
        """Per logical expert, its physical slots, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.physical_to_logical):
            out[e].append(p)
        return out

    def replica_table(self) -> list[list[int]]:
        """[E][R + 1] with R the redundant slots: expert e's replicas, repeated cyclically to the
        width, so column ``t % (R + 1)`` spreads tokens over them (evenly when the count divides)."""
        width = self.num_physical - self.num_logical + 1
        return [[reps[i % len(reps)] for i in range(width)] for reps in self.replicas()]

    def rank_loads(self, load: list[float]) -> list[float]:
        """Each rank's share of a layer's per-logical-expert ``load``, split evenly over replicas."""
        reps = self.replicas()
        out = [0.0] * self.ep_size
        for p, e in enumerate(self.physical_to_logical):
            out[p // self.slots_per_rank] += load[e] / len(reps[e])
        return out


def check_physical_to_logical(row: list[int], num_logical: int, ep_size: int) -> None:
    """ValueError naming what is wrong with one layer's physical -> logical map."""
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if len(row) < num_logical or len(row) % ep_size:
        raise ValueError(f"a layer's physical slots must number >= the {num_logical} experts and be a multiple of "
                         f"ep_size {ep_size}, got {len(row)}")
    bad = [e for e in row if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < num_logical]
    if bad:
        raise ValueError(f"physical slots must hold logical experts in [0, {num_logical}), got {bad[0]!r}")
    missing = sorted(set(range(num_logical)) - set(row))
    if missing:
        raise ValueError(f"every logical expert needs a physical slot; expert {missing[0]} has none")


def contiguous_placement(num_experts: int, ep_size: int) -> ExpertPlacement:
    """``ep_size`` equal runs of consecutive experts; ValueError naming both when they do not divide."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the model's {num_experts} routed experts")
    return ExpertPlacement(tuple(range(num_experts)), num_experts, ep_size)


def trivial_placement(num_experts: int, num_redundant: int, ep_size: int) -> ExpertPlacement:
    """SGLang's ``trivial`` location: slot ``p`` holds expert ``p % E`` (the redundant slots repeat
    experts 0, 1, ... until the load says which are hot); ValueError when ``E + R`` is not a multiple
    of ``ep_size``."""
    physical = num_experts + num_redundant
    if num_redundant < 0 or physical % ep_size:
        raise ValueError(f"ep_num_redundant_experts {num_redundant} plus the model's {num_experts} routed experts "
                         f"must be a multiple of ep_size {ep_size}")
    return ExpertPlacement(tuple(p % num_experts for p in range(physical)), num_experts, ep_size)
