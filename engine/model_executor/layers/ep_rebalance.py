"""EPLB's placement rule: a new ``ExpertPlacement`` of a MoE layer from its recorded per-expert load.

Pure functions, no tensors, no ranks. As DeepSeek's EPLB in its global policy (one node: no
hierarchy of node groups), in two greedy passes:

1. **Replicate.** Every logical expert gets one slot; each of the R redundant slots goes, in turn,
   to the expert whose load per replica is the largest (ties: the lower expert id). An expert's
   tokens are then split evenly over its replicas (the router spreads them by token index).
2. **Pack.** The replicas, heaviest first, go to the least-loaded rank that still has a free slot
   (``P / ep_size`` per rank), preferring a rank that holds no replica of the same expert yet (a
   second copy on one rank balances nothing). Within a rank, an expert that the old placement
   already held in a slot of that rank keeps that slot, so its weights need not move.

Every logical expert keeps >= 1 replica and every rank gets exactly its capacity of slots;
``rank_imbalance`` (max over mean of the ranks' loads) is what the rebalance lowers. A new
placement that does not lower it is not taken: a rebalance that buys nothing moves no weight.
"""

from __future__ import annotations

from pdserve.engine.model_executor.layers.ep_placement import ExpertPlacement


def replica_counts(load: list[float], num_physical: int) -> list[int]:
    """Per logical expert, how many of ``num_physical`` slots it gets (each >= 1)."""
    counts = [1] * len(load)
    for _ in range(num_physical - len(load)):
        e = max(range(len(load)), key=lambda i: (load[i] / counts[i], -i))
        counts[e] += 1
    return counts


def pack(load: list[float], counts: list[int], ep_size: int) -> list[list[int]]:
    """Per rank, the logical experts of its slots (each rank ``sum(counts) / ep_size`` of them)."""
    capacity = sum(counts) // ep_size
    items = sorted(((load[e] / counts[e], e) for e in range(len(load)) for _ in range(counts[e])),
                   key=lambda w_e: (-w_e[0], w_e[1]))
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    weight = [0.0] * ep_size
    for w, e in items:
        free = [r for r in range(ep_size) if len(ranks[r]) < capacity]
        fresh = [r for r in free if e not in ranks[r]] or free
        r = min(fresh, key=lambda i: (weight[i], i))
        ranks[r].append(e)
        weight[r] += w
    return ranks


def rebalance_layer(load: list[float], old: ExpertPlacement) -> ExpertPlacement:
    """The new placement of one layer with ``old``'s shape (slots, ranks) for per-expert ``load``."""
    if len(load) != old.num_logical:
        raise ValueError(f"load has {len(load)} experts, the placement {old.num_logical}")
    per_rank = pack([float(x) for x in load], replica_counts([float(x) for x in load], old.num_physical),
                     old.ep_size)
    s = old.slots_per_rank
    physical: list[int] = []
    for r, experts in enumerate(per_rank):
        slots: list[int | None] = [None] * s
        rest = sorted(experts)
        for i in range(s):  # an expert already in slot i of this rank stays there
            kept = old.physical_to_logical[r * s + i]
            if kept in rest:
                slots[i] = kept
                rest.remove(kept)
        for i in range(s):
            if slots[i] is None:
                slots[i] = rest.pop(0)
        physical.extend(slots)  # type: ignore[arg-type]
    new = ExpertPlacement(tuple(physical), old.num_logical, old.ep_size)
    return new if rank_imbalance(new, load) < rank_imbalance(old, load) else old


def rank_imbalance(placement: ExpertPlacement, load: list[float]) -> float:
    """max / mean of the ranks' loads under ``placement`` (1.0: balanced; 1.0 for no load)."""
    loads = placement.rank_loads([float(x) for x in load])
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
