"""A set of integer ids handed out and given back: the KV pool's pages and the host tier's slots.

LIFO: a recently freed id is handed out first (its memory is warm in cache). The list can prove
its invariant, free + used = all, with no id on both sides or freed twice.
"""

from __future__ import annotations

from collections.abc import Iterable


class FreeList:
    def __init__(self, ids: Iterable[int], what: str):
        """``ids`` in the order they are popped from the end; ``what`` names one id in errors."""
        self._free: list[int] = list(ids)
        self._used: set[int] = set()
        self.total = len(self._free)
        self.what = what

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def take(self, n: int) -> list[int] | None:
        """``n`` ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def give_back(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.what} {i} freed but not in use")
            self._used.remove(i)
            self._free.append(i)

    def check_integrity(self) -> set[int]:
        """Prove free + used = total with no id twice; returns the free set for callers' checks."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"a {self.what} is on the free list twice")
        if free & self._used:
            raise AssertionError(f"{self.what}s both free and used: {sorted(free & self._used)[:8]}")
        if len(free) + len(self._used) != self.total:
            raise AssertionError(f"{self.what}s free {len(free)} + used {len(self._used)} != {self.total}")
        return free
