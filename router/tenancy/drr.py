"""Deficit round-robin between flows (tenants), a priority queue inside each flow.

Pure bookkeeping: no clock, no sockets. Each flow with waiting entries sits on a ring; a visit to
the flow at the ring's head credits it ``quantum * weight``, and the flow is served while its head
entry's cost (tokens) fits its deficit, then the ring turns. Over time every backlogged flow gets
tokens in proportion to its weight, whatever the size of its requests and however many it sends.
Inside a flow, entries leave by rank (smaller first), arrival order among equals. A flow that
empties leaves the ring with its deficit reset (classic DRR: an idle flow banks no credit).
A flow the caller marks ineligible (at its concurrency cap) is passed over without credit.

The quantum sets how fine the sharing is: a visit serves up to ``quantum * weight`` tokens, so a
quantum far above the requests' cost lets a flooding flow send a run of them per visit. It is
small, and a round in which no flow can pay for its head is not walked visit by visit: every
eligible flow is credited at once with the rounds that would pass before the first can pay, so a
pop costs O(flows) whatever the ratio of request cost to quantum.
"""

from __future__ import annotations

import heapq
import math
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_QUANTUM = 1  # a token per visit at weight 1: tenants take turns request by request


@dataclass(order=True)
class Entry(Generic[T]):
    rank: float
    seq: int
    cost: int = field(compare=False)
    item: T = field(compare=False)


@dataclass
class _Flow:
    weight: float
    heap: list = field(default_factory=list)
    deficit: float = 0.0
    credited: bool = False  # credited on this visit (the flow is at the ring's head)


class DeficitRoundRobin(Generic[T]):
    def __init__(self, quantum: int = DEFAULT_QUANTUM):
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self.quantum = quantum
        self._flows: dict[str, _Flow] = {}
        self._ring: deque[str] = deque()
        self._seq = itertools.count()

    def push(self, flow: str, weight: float, rank: float, cost: int, item: T) -> Entry[T]:
        f = self._flows.get(flow)
        if f is None:
            f = self._flows[flow] = _Flow(weight)
        f.weight = weight
        if not f.heap:
            self._ring.append(flow)
        entry = Entry(rank, next(self._seq), max(1, cost), item)
        heapq.heappush(f.heap, entry)
        return entry

    def entries(self) -> Iterator[tuple[str, Entry[T]]]:
        """Every entry still queued (dead ones included until popped past)."""
        for name, f in self._flows.items():
            for e in f.heap:
                yield name, e

    def remove(self, flow: str, entry: Entry[T]) -> None:
        """Take ``entry`` out (it left the queue another way: displaced)."""
        f = self._flows[flow]
        f.heap.remove(entry)
        heapq.heapify(f.heap)
        if not f.heap:
            self._drop(flow)

    def pop(self, eligible: Callable[[str], bool], alive: Callable[[T], bool]) -> tuple[str, T] | None:
        """The next entry by DRR among eligible flows, skipping entries no longer ``alive``;
        None when no eligible flow has a live entry."""
        self._prune(alive)
        if not any(eligible(n) for n in self._ring):
            return None
        passed = 0  # visits in a row that served nothing
        while True:
            if passed >= len(self._ring):
                self._skip_idle_rounds(eligible)
                passed = 0
            name = self._ring[0]
            f = self._flows[name]
            if not eligible(name):
                f.credited = False
                self._ring.rotate(-1)
                passed += 1
                continue
            if not f.credited:
                f.deficit += self.quantum * f.weight
                f.credited = True
            head = f.heap[0]
            if head.cost <= f.deficit:
                heapq.heappop(f.heap)
                f.deficit -= head.cost
                self._prune_flow(name, alive)
                return name, head.item
            f.credited = False
            self._ring.rotate(-1)
            passed += 1

    def _skip_idle_rounds(self, eligible: Callable[[str], bool]) -> None:
        """After a whole round that served nothing: credit every eligible flow with the further
        rounds in which none of them could pay for its head either (what walking them would do)."""
        needs = []
        for name in self._ring:
            f = self._flows[name]
            if eligible(name):
                credit = self.quantum * f.weight
                needs.append((f, credit, math.ceil((f.heap[0].cost - f.deficit) / credit)))
        rounds = min(n for _, _, n in needs) - 1
        if rounds > 0:
            for f, credit, _ in needs:
                f.deficit += rounds * credit

    def _prune(self, alive: Callable[[T], bool]) -> None:
        for name in list(self._ring):
            self._prune_flow(name, alive)

    def _prune_flow(self, name: str, alive: Callable[[T], bool]) -> None:
        f = self._flows[name]
        while f.heap and not alive(f.heap[0].item):
            heapq.heappop(f.heap)
        if not f.heap:
            self._drop(name)

    def _drop(self, name: str) -> None:
        self._ring.remove(name)
        del self._flows[name]  # a flow with nothing queued keeps no state
