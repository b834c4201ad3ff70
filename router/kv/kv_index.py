"""Which endpoint holds which KV block, in which tier, rebuilt from the workers' KV events.

Pure bookkeeping, no sockets: ``KVIndex`` maps chained block hashes (see
``pdserve.engine.mem_cache.kv_events``) to the endpoint keys that hold them, per
tier (``router/kv/kv_tiers.py``: each worker's pool, host memory and disk, and the
store they share), and answers which leading blocks of a prompt each endpoint
holds and where.
Between routing a request and its worker's ``BlockStored`` event, the blocks
are *predicted* in the chosen endpoint's pool (``predict``, until a deadline), as
Dynamo's router does, so that a burst of one prefix group does not scatter
before the first event arrives; a removal or clear of the endpoint drops its
predictions with its blocks. The shared store's blocks are kept up to
``max_store_blocks``, least recently stored dropped first: a store evicts
objects without telling anyone, so the index keeps the newest and forgets the
oldest. ``SeqTracker`` checks one publisher's sequence numbers and says what to do with
each batch (apply it, ask for a replay, treat the publisher as restarted, or
drop a stale one).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Iterable, Sequence

from pdserve.engine.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.router.kv.kv_tiers import LOCAL_TIERS, Tier, tier_of

MAX_STORE_BLOCKS = 1 << 19  # ~50 MB of router memory; 8M tokens of 16-token pages


class _Holders:
    """One local tier: block hash -> endpoint keys, and back."""

    def __init__(self):
        self.by_hash: dict[int, set[str]] = {}
        self.by_key: dict[str, set[int]] = {}

    def add(self, key: str, h: int) -> None:
        self.by_key.setdefault(key, set()).add(h)
        self.by_hash.setdefault(h, set()).add(key)

    def discard(self, key: str, h: int) -> None:
        self.by_key.get(key, set()).discard(h)
        holders = self.by_hash.get(h)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self.by_hash[h]

    def clear(self, key: str) -> None:
        for h in self.by_key.pop(key, ()):
            holders = self.by_hash[h]
            holders.discard(key)
            if not holders:
                del self.by_hash[h]

    def holds(self, key: str, h: int) -> bool:
        return key in self.by_hash.get(h, ())


class KVIndex:
    def __init__(self, max_store_blocks: int = MAX_STORE_BLOCKS):
        self._local = {t: _Holders() for t in LOCAL_TIERS}
        self._store: OrderedDict[int, None] = OrderedDict()  # the shared store's blocks, oldest first
        self.max_store_blocks = max_store_blocks
        self._predicted: dict[str, dict[int, float]] = {}  # endpoint key -> block hash -> until
        self.unknown_media = 0  # events of a tier this index does not know (ignored)

    def apply(self, key: str, events: Iterable[KVEvent]) -> None:
        """Apply one endpoint's events in order (removals of unknown blocks are ignored)."""
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.clear(key)
                continue
            tier = tier_of(ev.medium)
            if tier is None:
                self.unknown_media += 1
            elif isinstance(ev, BlockStored):
                self._stored(key, tier, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self._removed(key, tier, ev.block_hashes)

    def _stored(self, key: str, tier: Tier, hashes: Sequence[int]) -> None:
        if tier is Tier.STORAGE:
            for h in hashes:
                self._store[h] = None
                self._store.move_to_end(h)
            while len(self._store) > self.max_store_blocks:
                self._store.popitem(last=False)
            return
        for h in hashes:
            self._local[tier].add(key, h)

    def _removed(self, key: str, tier: Tier, hashes: Sequence[int]) -> None:
        if tier is Tier.STORAGE:
            for h in hashes:
                self._store.pop(h, None)
            return
        guesses = self._predicted.get(key, {}) if tier is Tier.POOL else {}
        for h in hashes:
            self._local[tier].discard(key, h)
            guesses.pop(h, None)

    def clear(self, key: str) -> None:
        """Forget every block of ``key`` in its own tiers (flushed, restarted, removed, or its
        stream broke); what it put in the shared store stays there."""
        for holders in self._local.values():
            holders.clear(key)
        self._predicted.pop(key, None)

    def predict(self, key: str, hashes: Sequence[int], until: float) -> None:
        """Count ``hashes`` as in ``key``'s pool until time ``until`` (or their stored event)."""
        guesses = self._predicted.setdefault(key, {})
        if len(guesses) > _PRUNE_AT:
            now_gone = [h for h, t in guesses.items() if t < until - _PRUNE_AGE]
            for h in now_gone:
                del guesses[h]
        held = self._local[Tier.POOL].by_key.get(key, set())
        for h in hashes:
            if h not in held:
                guesses[h] = until

    def block_tiers(self, hashes: Sequence[int], keys: Iterable[str], now: float = 0.0) -> dict[str, list[Tier]]:
        """For each of ``keys``: the best tier of each leading block of ``hashes`` it can use (its
        pool, predictions included, then its host memory and disk, then the shared store), up to
        the first block it finds nowhere (a block's KV is of use only after its parent's)."""
        out: dict[str, list[Tier]] = {k: [] for k in keys}
        alive = list(out)
        guesses = {k: self._predicted.get(k, {}) for k in out}
        pool, host, disk = (self._local[t] for t in LOCAL_TIERS)
        for h in hashes:
            in_store = h in self._store
            pool_keys, host_keys, disk_keys = (pool.by_hash.get(h, ()), host.by_hash.get(h, ()),
                                               disk.by_hash.get(h, ()))
            still = []
            for k in alive:
                if k in pool_keys or guesses[k].get(h, -1.0) >= now:
                    out[k].append(Tier.POOL)
                elif k in host_keys:
                    out[k].append(Tier.HOST)
                elif k in disk_keys:
                    out[k].append(Tier.DISK)
                elif in_store:
                    out[k].append(Tier.STORAGE)
                else:
                    continue
                still.append(k)
            alive = still
            if not alive:
                break
        return out

    def overlap(self, hashes: Sequence[int], keys: Iterable[str], now: float = 0.0) -> dict[str, int]:
        """For each of ``keys``: how many leading blocks of ``hashes`` its pool holds or is
        predicted to hold at time ``now``."""
        tiers = self.block_tiers(hashes, keys, now)
        return {k: next((i for i, t in enumerate(ts) if t is not Tier.POOL), len(ts)) for k, ts in tiers.items()}

    def num_blocks(self, key: str) -> int:
        """Blocks in ``key``'s pool."""
        return len(self._local[Tier.POOL].by_key.get(key, ()))

    def holders(self, h: int) -> set[str]:
        """The endpoints whose pool holds block ``h``."""
        return set(self._local[Tier.POOL].by_hash.get(h, ()))

    def in_store(self, h: int) -> bool:
        return h in self._store

    def keys(self) -> list[str]:
        """Endpoints holding any block in a tier of their own."""
        return sorted({k for holders in self._local.values() for k, v in holders.by_key.items() if v})


_PRUNE_AT = 65536  # predictions kept per endpoint before expired ones are pruned
_PRUNE_AGE = 3600.0  # pruned: predictions whose deadline is this much older than the newest


class SeqAction(enum.Enum):
    APPLY = "apply"  # the next batch in order
    GAP = "gap"  # batches were missed: replay from ``expected``, else drop the endpoint's entries
    RESTART = "restart"  # the publisher started again from 0: drop its entries, then apply
    STALE = "stale"  # a batch already seen (a replay overlapping the live stream): ignore


class SeqTracker:
    """Sequence numbers of one publisher (one DP rank of one worker)."""

    def __init__(self):
        self.last: int | None = None  # last applied

    @property
    def expected(self) -> int:
        return 0 if self.last is None else self.last + 1

    def check(self, seq: int) -> SeqAction:
        if seq == self.expected:
            return SeqAction.APPLY
        if seq > self.expected:
            return SeqAction.GAP
        # a publisher counts from 0 again only when it restarted
        return SeqAction.RESTART if seq == 0 else SeqAction.STALE

    def applied(self, seq: int) -> None:
        self.last = seq
