"""Which adapters sit in a rank's LoRA slots: loaded on demand, evicted least recently used, never while in use.

Pure bookkeeping (no tensors): the model's slot stacks hold what this table says.
A running request pins its adapter's slot until it finishes; ``acquire`` evicts
only unpinned slots, and ``unload`` of a pinned adapter is refused, so an adapter
never changes under a running request. ``--max-loras-per-batch`` slots bound the
adapters of one batch, and so the memory the stacks take.
"""

from __future__ import annotations

from collections import OrderedDict


class LoraSlotsFull(RuntimeError):
    """Every slot holds an adapter a running request uses: the request waits or is refused."""


class AdapterInUse(RuntimeError):
    """An adapter that running requests still use cannot be unloaded."""


class LoraSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._pins: dict[str, int] = {}

    def slot_of(self, name: str) -> int | None:
        return self._slot.get(name)

    def acquire(self, name: str) -> tuple[int, str | None]:
        """Pin ``name`` for a request: (its slot, the adapter evicted to make room or None).
        The caller loads the adapter into the slot when it was not there (slot_of was None)."""
        evicted = None
        if name not in self._slot:
            used = set(self._slot.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((n for n in self._slot if not self._pins.get(n)), None)
                if victim is None:
                    raise LoraSlotsFull(f"all {self.num_slots} LoRA slots are in use by running requests")
                slot = self._slot.pop(victim)
                evicted = victim
            self._slot[name] = slot
        self._slot.move_to_end(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        return self._slot[name], evicted

    def release(self, name: str) -> None:
        """A request that pinned ``name`` finished."""
        left = self._pins.get(name, 0) - 1
        if left < 0:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        if left:
            self._pins[name] = left
        else:
            self._pins.pop(name, None)

    def unload(self, name: str) -> int | None:
        """Free ``name``'s slot (returned; None when it held none); AdapterInUse while requests use it."""
        if self._pins.get(name):
            raise AdapterInUse(f"adapter {name!r} is in use by {self._pins[name]} running request(s)")
        return self._slot.pop(name, None)

    def check_integrity(self) -> None:
        slots = list(self._slot.values())
        assert len(slots) == len(set(slots)) and all(0 <= s < self.num_slots for s in slots), self._slot
        assert set(self._pins) <= set(self._slot), (self._pins, self._slot)
