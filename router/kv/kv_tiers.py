"""The KV cache tiers ``kv_aware`` tells apart, and what a cached block in each is worth.

Pure: no sockets, no state. A worker's events name a block's tier in vLLM's
``medium`` field (``pdserve.engine.mem_cache.kv_events``); ``tier_of`` reads
vLLM's spellings and those of SGLang's HiCache and NVIDIA Dynamo, so a cluster
of mixed engines is read alike:

- ``POOL``: the worker's KV pool, what its scheduler computes in ("GPU"; also
  "DEVICE"; an absent medium, as older publishers send, is this tier).
- ``HOST``: the worker's host memory ("CPU"; SGLang's "CPU_TIER1", Dynamo's
  "CPU_PINNED"): the block costs a copy into the pool.
- ``DISK``: the worker's own disk ("DISK", "NVME"): a read, then the copy.
- ``STORAGE``: a store every worker reads ("STORAGE", pdserve's and vLLM's name;
  SGLang's HiCache L3 "CPU_TIER2"; Dynamo's "EXTERNAL", "SHARED", "REMOTE",
  "NETWORK"): a block there counts for every worker, since any of them
  prefetches it.

A prompt's blocks are a chain (each hash covers its parent), so only a
worker's leading run of blocks held in some tier is of use; ``tier_credit``
sums the weights of that run, each block at the best tier that holds it.
Why these weights: docs/ROUTER.md ("Tiers and decode workers").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class Tier(enum.IntEnum):
    """Best first: a block held in several tiers counts at the lowest value."""

    POOL = 0
    HOST = 1
    DISK = 2
    STORAGE = 3


LOCAL_TIERS = (Tier.POOL, Tier.HOST, Tier.DISK)  # a worker's own; STORAGE is shared

_MEDIA = {
    "GPU": Tier.POOL, "DEVICE": Tier.POOL,
    "CPU": Tier.HOST, "CPU_TIER1": Tier.HOST, "CPU_PINNED": Tier.HOST,
    "DISK": Tier.DISK, "NVME": Tier.DISK,
    "STORAGE": Tier.STORAGE, "CPU_TIER2": Tier.STORAGE, "EXTERNAL": Tier.STORAGE,
    "SHARED": Tier.STORAGE, "REMOTE": Tier.STORAGE, "NETWORK": Tier.STORAGE,
}


def tier_of(medium: str | None) -> Tier | None:
    """The tier an event's ``medium`` names (None: the pool); None for one it does not know."""
    if medium is None:
        return Tier.POOL
    return _MEDIA.get(medium.upper())


@dataclass(frozen=True)
class TierWeights:
    """What a cached block saves against computing it, per tier (the pool's is 1: all of it).

    ``host`` and ``storage`` are ``--kv-host-cache-hit-weight`` and
    ``--kv-storage-cache-hit-weight``; a worker's disk counts as storage does (a
    read from a slower medium, then the copy)."""

    host: float = 0.8
    storage: float = 0.5

    def __post_init__(self):
        for name in ("host", "storage"):
            w = getattr(self, name)
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"the {name} tier's cache hit weight must be in [0, 1], got {w}")

    def of(self, tier: Tier) -> float:
        if tier is Tier.POOL:
            return 1.0
        return self.host if tier is Tier.HOST else self.storage


def tier_credit(tiers: Iterable[Tier], weights: TierWeights) -> float:
    """Blocks of compute a worker saves on a prompt whose leading blocks it holds in ``tiers``."""
    return sum(weights.of(t) for t in tiers)
