"""Which prefill endpoint holds which KV block, rebuilt from the workers' KV events.

Pure bookkeeping, no sockets: ``KVIndex`` maps chained block hashes (see
``pdserve.engine.mem_cache.kv_events``) to the endpoint keys that hold them, and
answers how many leading blocks of a prompt each endpoint holds.
Between routing a request and its worker's ``BlockStored`` event, the blocks
are *predicted* on the chosen endpoint (``predict``, until a deadline), as
Dynamo's router does, so that a burst of one prefix group does not scatter
before the first event arrives; a removal or clear of the endpoint drops its
predictions with its blocks. ``SeqTracker`` checks one publisher's sequence numbers and says what to do with
each batch (apply it, ask for a replay, treat the publisher as restarted, or
drop a stale one).
"""

from __future__ import annotations

import enum
from typing import Iterable, Sequence

from pdserve.engine.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVIndex:
    def __init__(self):
        self._holders: dict[int, set[str]] = {}  # block hash -> endpoint keys
        self._blocks: dict[str, set[int]] = {}  # endpoint key -> block hashes
        self._predicted: dict[str, dict[int, float]] = {}  # endpoint key -> block hash -> until

    def apply(self, key: str, events: Iterable[KVEvent]) -> None:
        """Apply one endpoint's events in order (removals of unknown blocks are ignored)."""
        mine = self._blocks.setdefault(key, set())
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    mine.add(h)
                    self._holders.setdefault(h, set()).add(key)
            elif isinstance(ev, BlockRemoved):
                guesses = self._predicted.get(key, {})
                for h in ev.block_hashes:
                    mine.discard(h)
                    guesses.pop(h, None)
                    self._drop_holder(h, key)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(key)
                mine = self._blocks.setdefault(key, set())

    def clear(self, key: str) -> None:
        """Forget every block of ``key`` (flushed, restarted, removed, or its stream broke)."""
        for h in self._blocks.pop(key, ()):
            self._drop_holder(h, key)
        self._predicted.pop(key, None)

    def predict(self, key: str, hashes: Sequence[int], until: float) -> None:
        """Count ``hashes`` as held by ``key`` until time ``until`` (or their stored event)."""
        guesses = self._predicted.setdefault(key, {})
        if len(guesses) > _PRUNE_AT:
            now_gone = [h for h, t in guesses.items() if t < until - _PRUNE_AGE]
            for h in now_gone:
                del guesses[h]
        held = self._blocks.get(key, set())
        for h in hashes:
            if h not in held:
                guesses[h] = until

    def _drop_holder(self, h: int, key: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._holders[h]

    def overlap(self, hashes: Sequence[int], keys: Iterable[str], now: float = 0.0) -> dict[str, int]:
        """For each of ``keys``: how many leading blocks of ``hashes`` it holds or is predicted to
        hold at time ``now`` (a prefix match: a block's KV is of use only after its parent's)."""
        out = dict.fromkeys(keys, 0)
        alive = set(out)
        guesses = {k: self._predicted.get(k, {}) for k in out}
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, set())
            alive = {k for k in alive if k in holders or guesses[k].get(h, -1.0) >= now}
            if not alive:
                break
            for k in alive:
                out[k] = i + 1
        return out

    def num_blocks(self, key: str) -> int:
        return len(self._blocks.get(key, ()))

    def holders(self, h: int) -> set[str]:
        return set(self._holders.get(h, ()))

    def keys(self) -> list[str]:
        return [k for k, v in self._blocks.items() if v]


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
